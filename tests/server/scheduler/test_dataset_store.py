"""`DatasetStore` alone: messages in, effects out, no sockets and no clock.

The store extends a `Coordination`: published values hold their Futures' keys like a
Variable's, handoffs are confirmed with ``value-received``, the limits are shared, and a
refused message changes nothing.
"""
import pytest

from distributed_server.scheduler.coordination import Coordination, CoordinationLimits
from distributed_server.scheduler.datasets import OPS, DatasetStore

KNOWN = {"k1", "k2", "k3"}


class Store:
    """A Coordination with a DatasetStore, driven with increasing request ids."""

    def __init__(self, **limits) -> None:
        self.coord = Coordination(KNOWN.__contains__, CoordinationLimits(**limits))
        self.store = DatasetStore(self.coord)
        self.reqid = 0

    def __call__(self, client: str, op: str, **fields) -> list:
        self.reqid += 1
        effects = self.coord.handle(client, {"op": op, "reqid": self.reqid, **fields}, 0.0)
        self.coord.validate()
        return effects

    def put(self, client: str, override=False, **values) -> list:
        return self("c1" if client is None else client, "dataset-put", override=override,
                    datasets=[{"name": n, "value": v[0], "keys": v[1]}
                              for n, v in values.items()])


def results(effects: list) -> list:
    return [e[2].get("result", e[2].get("error")) for e in effects if e[0] == "send"]


def holds(effects: list) -> list:
    return [(e[0], sorted(e[1])) for e in effects if e[0] != "send"]


def test_the_ops_are_served_by_the_coordination_they_extend():
    s = Store()
    assert OPS == {"dataset-put", "dataset-get", "dataset-list", "dataset-delete"}
    assert OPS <= set(s.coord._handlers)


def test_a_put_holds_the_keys_until_the_dataset_is_deleted():
    s = Store()
    effects = s.put("c1", a=(b"A", ["k1", "k2"]), b=(b"B", []))
    assert results(effects) == [{"status": "ok"}]
    assert holds(effects) == [("hold", ["k1", "k2"])]
    assert results(s("c2", "dataset-list")) == [{"status": "ok", "names": ["a", "b"]}]
    effects = s("c1", "dataset-delete", name="a")
    assert results(effects) == [{"status": "ok", "deleted": True}]
    assert holds(effects) == [("drop", ["k1", "k2"])]
    assert results(s("c1", "dataset-delete", name="a")) == [{"status": "ok",
                                                             "deleted": False}]


def test_a_get_hands_the_value_over_and_holds_its_keys_until_received():
    s = Store()
    s.put("c1", a=(b"A", ["k1"]))
    reply = results(s("c2", "dataset-get", name="a"))[0]
    assert reply["status"] == "ok" and reply["value"] == b"A"
    effects = s("c1", "dataset-delete", name="a")
    assert holds(effects) == []  # the handoff to c2 still holds k1
    effects = s("c2", "value-received", handoff=reply["handoff"])
    assert holds(effects) == [("drop", ["k1"])]
    assert results(s("c2", "dataset-get", name="a")) == [{"status": "missing"}]


def test_a_published_name_is_answered_exists_and_nothing_is_published():
    s = Store()
    s.put("c1", a=(b"A", ["k1"]))
    effects = s.put("c2", b=(b"B", ["k2"]), a=(b"A2", []))
    assert results(effects) == [{"status": "exists", "names": ["a"]}]
    assert holds(effects) == [] and list(s.store.values) == ["a"]
    effects = s.put("c2", override=True, a=(b"A2", ["k3"]))
    assert holds(effects) == [("hold", ["k3"]), ("drop", ["k1"])]
    assert s.coord.total_bytes == 2


@pytest.mark.parametrize("fields, error", [
    ({"datasets": []}, "must be a list of 1 to"),
    ({"datasets": ["x"]}, "each dataset must be a map"),
    ({"datasets": [{"name": 1, "value": b"x"}]}, "the name must be a str"),
    ({"datasets": [{"name": "a", "value": b"x"}, {"name": "a", "value": b"y"}]},
     "appears twice"),
    ({"datasets": [{"name": "a", "value": "text"}]}, "must be bytes"),
    ({"datasets": [{"name": "a", "value": b"x", "keys": ["unknown"]}]}, "does not know"),
    ({"datasets": [{"name": "a", "value": b"x"}], "override": "yes"}, "override must be"),
    ({"datasets": [{"name": "a", "value": b"x" * 11}]}, "at most 10 bytes per value"),
])
def test_bad_puts_are_refused_and_change_nothing(fields, error):
    s = Store(max_value_bytes=10)
    s.put("c1", kept=(b"K", ["k1"]))
    before = (dict(s.store.values), dict(s.coord.held), s.coord.total_bytes)
    effects = s("c1", "dataset-put", **fields)
    assert len(effects) == 1 and error in effects[0][2]["error"]
    assert (dict(s.store.values), dict(s.coord.held), s.coord.total_bytes) == before


def test_the_shared_limits_on_total_bytes_and_names_apply():
    s = Store(max_total_bytes=10)
    s.put("c1", a=(b"x" * 6, []))
    effects = s.put("c1", b=(b"y" * 6, []))
    assert "does not fit" in results(effects)[0]
    effects = s.put("c1", b=(b"y" * 3, []), c=(b"z" * 3, []))  # each fits, not both
    assert "(6 bytes) do not fit" in results(effects)[0]
    s = Store(max_names=2)
    s.put("c1", a=(b"x", []))
    s.put("c1", b=(b"y", []))
    effects = s.put("c1", c=(b"z", []))
    assert "datasets" in results(effects)[0] and "most it may" in results(effects)[0]
    assert list(s.store.values) == ["a", "b"]


def test_keys_lost_after_a_restart_leave_the_value_but_not_its_keys():
    s = Store()
    s.put("c1", a=(b"A", ["k1", "k2"]))
    s.coord.keys_lost({"k2"})
    assert s.store.values["a"].keys == ("k2",) and s.coord.held == {"k2": 1}
    s.coord.validate()
