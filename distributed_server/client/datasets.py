"""Published datasets, the client's side: ``Client.publish_dataset``, ``get_dataset``,
``list_datasets``, ``unpublish_dataset`` and the ``Client.datasets`` mapping, with
dask.distributed's names, signatures and errors.

What this module does
---------------------
A dataset is a value published under a name (a str) in the scheduler
(`distributed_server.scheduler.datasets`), where every client, and every task that opens a
client, can get it until it is unpublished. Values are pickled here, as the coordination
primitives' are (`distributed_server.client.primitives.dumps_value`): Futures anywhere inside
(a persisted dask collection holds many) travel as their keys, and the scheduler keeps
their tasks alive while the dataset is published, after every client released them.
A client that gets the dataset receives Futures of the same keys.

What it never does
------------------
It keeps no state of its own: the scheduler's store is the only copy. It never sends a
value over 16 MiB pickled (publish large data as Futures: scatter or persist it first).
"""
from __future__ import annotations

from collections.abc import MutableMapping

from .primitives import check_name, confirm, dumps_value, graphs_sent, receive

__all__ = ["NO_DEFAULT", "Datasets", "DatasetsMixin", "get_dataset", "list_datasets",
           "publish_dataset", "unpublish_dataset"]


class _NoDefault:
    def __repr__(self) -> str:
        return "<no default>"


#: ``get_dataset``'s default: raise KeyError when the name is not published.
NO_DEFAULT = _NoDefault()


def _named(args: tuple, kwargs: dict) -> tuple[dict, bool]:
    """``({name: value}, override)`` from ``publish_dataset``'s arguments, as dask reads
    them: ``(value, name=...)``, collections with a ``.name`` (dask's), or
    ``name=value`` keywords; ``override=`` says whether a published name may be replaced."""
    kwargs = dict(kwargs)
    override = kwargs.pop("override", False)
    if type(override) is not bool:
        raise TypeError(f"override must be True or False, not {override!r:.100}")
    named: dict = {}
    if "name" in kwargs:
        name = kwargs.pop("name")
        if not args:
            raise ValueError("If name is provided, expecting call signature like "
                             "publish_dataset(df, name='ds')")
        named[name] = args[0] if len(args) == 1 else args
    else:
        for arg in args:
            name = getattr(arg, "name", None)
            if not isinstance(name, str):
                raise ValueError(f"publish_dataset: a positional argument must be a dask "
                                 f"collection (it has a .name), not {type(arg).__name__}; "
                                 f"pass name= or publish it as name=value")
            named[name] = arg
    for name, value in kwargs.items():
        if name in named:
            raise ValueError(f"publish_dataset: the name {name!r} is given twice")
        named[name] = value
    if not named:
        raise ValueError("publish_dataset needs something to publish: publish_dataset("
                         "value, name='...') or publish_dataset(name=value)")
    for name in named:
        check_name(name, "dataset")
    return named, override


def publish_dataset(client, args: tuple, kwargs: dict):
    """Publish values by name (see `_named`); all or none are published. A name already
    published raises KeyError unless ``override=True``."""
    named, override = _named(args, kwargs)
    entries = []
    for name, value in named.items():
        data, keys = dumps_value(value, f"publish_dataset {name!r}", "a dataset")
        entries.append({"name": name, "value": data, "keys": keys})
    return client._sync(_publish, client, entries, override)


async def _publish(client, entries: list, override: bool) -> None:
    await graphs_sent(client, [key for entry in entries for key in entry["keys"]])
    result = await client._request("dataset-put", datasets=entries, override=override)
    if result["status"] == "exists":
        names = ", ".join(repr(name) for name in result["names"])
        raise KeyError(f"Dataset {names} already exists (override=True replaces it); "
                       f"nothing was published")


def get_dataset(client, name, default=NO_DEFAULT):
    """The value published as ``name``, its Futures held by ``client``; ``default`` if
    none is (KeyError without a default)."""
    check_name(name, "dataset")
    return client._sync(_get, client, name, default)


async def _get(client, name: str, default):
    result = await client._request("dataset-get", on_abandon=lambda r: confirm(client, r),
                                   name=name)
    if result["status"] == "missing":
        if default is NO_DEFAULT:
            raise KeyError(f"Dataset '{name}' not found")
        return default
    return receive(client, result)


def list_datasets(client):
    """The names published, in publication order."""
    return client._sync(_list, client)


async def _list(client) -> list:
    return list((await client._request("dataset-list"))["names"])


def unpublish_dataset(client, name):
    """Unpublish ``name``; its Futures' tasks may then go. As in dask, a name not
    published is not an error."""
    check_name(name, "dataset")
    return client._sync(_delete, client, name)


async def _delete(client, name: str) -> None:
    await client._request("dataset-delete", name=name)


class Datasets(MutableMapping):
    """``Client.datasets``: the published datasets as a mapping (a get, set or delete is
    one request to the scheduler; setting a published name raises KeyError, as
    ``publish_dataset`` without ``override``). With an asynchronous client the item
    methods return awaitables and iteration is refused."""

    def __init__(self, client) -> None:
        self._client = client

    def __getitem__(self, name):
        return get_dataset(self._client, name)

    def __setitem__(self, name, value) -> None:
        self._check_sync("setting items")
        publish_dataset(self._client, (value,), {"name": name})

    def __delitem__(self, name) -> None:
        self._check_sync("deleting items")
        if name not in self:
            raise KeyError(f"Dataset '{name}' not found")
        unpublish_dataset(self._client, name)

    def __contains__(self, name) -> bool:
        self._check_sync("'in'")
        return isinstance(name, str) and name in list_datasets(self._client)

    def __iter__(self):
        self._check_sync("iteration")
        return iter(list_datasets(self._client))

    def __len__(self) -> int:
        self._check_sync("len()")
        return len(list_datasets(self._client))

    def _check_sync(self, what: str) -> None:
        if self._client.asynchronous:
            raise TypeError(f"Client.datasets: {what} needs a synchronous client; await "
                            f"the client's publish_dataset / list_datasets / "
                            f"unpublish_dataset instead")

    def __repr__(self) -> str:
        return f"<Datasets of {self._client!r}>"


class DatasetsMixin:
    """The dataset methods of `Client` (one of the classes it is made of): thin, over
    this module's functions."""

    def publish_dataset(self, *args, **kwargs):
        """Publish values by name in the scheduler, for every client: ``(value,
        name="x")``, ``(collection, ...)`` (named by their ``.name``) or ``(x=value,
        ...)``; all or none. Futures inside stay alive while published. KeyError if a
        name is published already, unless ``override=True``."""
        return publish_dataset(self, args, kwargs)

    def get_dataset(self, name: str, default=NO_DEFAULT):
        """The value published as ``name`` (its Futures now held by this client);
        ``default`` if there is none, else KeyError."""
        return get_dataset(self, name, default)

    def list_datasets(self) -> list:
        """The names of the published datasets."""
        return list_datasets(self)

    def unpublish_dataset(self, name: str) -> None:
        """Unpublish ``name`` (nothing happens if it is not published, as in dask)."""
        return unpublish_dataset(self, name)

    @property
    def datasets(self) -> Datasets:
        """The published datasets as a mutable mapping (`Datasets`)."""
        return Datasets(self)
