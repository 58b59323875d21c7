"""The worker process: the `Worker` server around a `WorkerCore`, its memory (spill,
pause, the execution gate), ``Client.run`` calls, and the task context (``get_worker``,
``secede``, ``rejoin``, the client factory).

May import: dashboard, comm, protocol, diagnostics, plugins and the shared leaves; never
the scheduler, the client or deploy.
"""
