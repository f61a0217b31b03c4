"""The REST API: FastAPI over the jobs store, in the OpenAI Batch API's shapes (OpenAPI at /docs).

    main.py            make_app(runtime): the app, its routers and the one JobsError -> HTTP status handler
    deps.py            Annotated dependencies: RuntimeDep, SessionDep (one per request), ApiKeyDep (Bearer key, never
                       cached: a revoked key fails at once); the operator's guards: the metrics token, the served models
    batch_request.py   the body of POST /v1/batches: a multipart JSONL upload or a JSON body, as one Submission
    metrics.py         a Prometheus collector that reads job/request counts and tokens from SQL (two GROUP BY
                       queries), reused for SWARMBATCH_METRICS_CACHE_SECONDS
    routes/            batches.py (/v1/batches...), health.py (/healthz, /metrics)

Routes stay thin: validation and state changes live in jobs.submission and jobs.store, output lines in
jobs.outputs; errors are raised as JobsError subclasses and translated to HTTP in main.py only.
"""
