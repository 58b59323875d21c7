"""The client side: `Client` and what it is made of — its futures and key table, the
connection to the scheduler, task specs, dask submission, transfers with workers,
coordination primitives, datasets, progress and performance reports.

May import: deploy (``Client()`` starts a `LocalCluster`), worker (a task's client
factory, ``Client.run``'s call packing), comm, protocol and the shared leaves; never the
scheduler.
"""
