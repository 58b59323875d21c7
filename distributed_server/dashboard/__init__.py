"""HTTP endpoints: the scheduler's live status page, JSON API and ``/metrics``, and a
worker's ``/metrics``.

    http.py            the tornado HTTP server of one process; plain-text errors
    auth.py            who may read (or change): the cluster's token, TLS certificates,
                       loopback
    figures.py         the scheduler's figures, read cheaply (the one place that counts)
    prometheus.py      collectors that turn figures into Prometheus metrics at scrape time
    scheduler_app.py   the scheduler's routes (/status, /api/v1/..., /metrics)
    cluster_api.py     the routes cluster managers scale with (adaptive_target, retire_workers, ...)
    worker_app.py      a worker's routes (/metrics)
    static/            the status page: hand-written HTML, CSS and JavaScript, no CDN

Every endpoint only reads, but one: ``POST /api/v1/retire_workers`` (cluster_api.py),
which needs the cluster's own credential.
"""
