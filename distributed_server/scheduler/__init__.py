"""The scheduler process: the `Scheduler` server (server.py) that holds a `SchedulerState`
and the services it routes messages to, each registering its handlers — restart through
the nannies (restart.py), the clients' key requests (client_keys.py), coordination
primitives and datasets (coordination_service.py over the I/O-free state in
coordination/ and datasets.py), graceful retirement and replica moves planned by the core
(retirement.py), scheduler plugins (plugins.py), stories and logs gathered from workers
(history.py, worker_requests.py).

May import: dashboard, comm, protocol, diagnostics, plugins and the shared leaves; never
the worker, the client or deploy.
"""
