"""distributed-core's server shell: comms, the Scheduler server, Worker, Client, LocalCluster."""
