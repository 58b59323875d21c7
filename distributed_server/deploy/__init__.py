"""Starting and supervising the processes of a cluster: `LocalCluster`, the cluster
managers on the `Cluster` base (`SLURMCluster` in ``slurm``: workers in SLURM batch jobs),
the nanny, the process helpers, and what ``dcore`` does around a server's start
(scheduler files, preloads, lifetime).

May import: scheduler, worker, comm, protocol and the shared leaves; never the client.
"""
