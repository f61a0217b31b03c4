"""The REST API: FastAPI over the jobs store, a drop-in for OpenAI's Files + Batch APIs (OpenAPI at /docs).

    main.py            make_app(runtime): the app, its routers and middleware, the JobsError -> HTTP status handler
    error_body.py      OpenAI's error body {"error": {message, type, param, code}}, for every 4xx and 5xx
    deps.py            Annotated dependencies: RuntimeDep, SessionDep (one per request), ApiKeyDep (Bearer key, never
                       cached: a revoked key fails at once); the operator's guards: the metrics token, the served models
    limits.py          BodyLimit middleware (413 before or while reading a body, 408 past its deadline)
    slots.py           per-key slots of submissions, uploads and downloads (429)
    send_deadline.py   the send deadline: a client that takes nothing of an answer for a while loses its connection
    batch_request.py   the body of POST /v1/batches: OpenAI's {input_file_id, endpoint, ...}, or ours (a multipart JSONL
                       upload or a JSON body of requests), as one Submission
    metrics.py         a Prometheus collector that reads job/request counts and tokens from SQL (two GROUP BY
                       queries), reused for SWARMBATCH_METRICS_CACHE_SECONDS
    docs.py            /docs (Swagger UI) from local files (the fastapi-offline package): works without the internet
    routes/            files.py (/v1/files...), batches.py (/v1/batches...), models.py (/v1/models...),
                       health.py (/healthz, /metrics), swarm.py (/v1/swarm: the workers' last swarm snapshots of the
                       served models)
    ui/                the web view at /ui/ (static HTML + JS + CSS, package data) over the REST routes above

Routes stay thin: validation and state changes live in jobs.submission and jobs.store, output lines in
jobs.outputs; errors are raised as JobsError subclasses and translated to HTTP in main.py only (limits.py's
ApiRefusal carries its own status: 413 and 429 are about the HTTP request, not about jobs).
"""
