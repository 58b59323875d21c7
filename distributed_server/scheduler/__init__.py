"""The scheduler process: the `Scheduler` server that holds a `SchedulerState` and the
services it hosts (coordination primitives, datasets, graceful retirement and replica
moves, scheduler plugins, requests to workers).

May import: dashboard, comm, protocol, diagnostics, plugins and the shared leaves; never
the worker, the client or deploy.
"""
