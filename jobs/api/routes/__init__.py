"""Routers of the REST API.

    files.py     POST/GET /v1/files, GET/DELETE /v1/files/{id}, GET /v1/files/{id}/content (OpenAI's Files API)
    batches.py   POST/GET /v1/batches, GET /v1/batches/{id}[/results|/errors], POST /v1/batches/{id}/cancel
    models.py    GET /v1/models, GET /v1/models/{id}: the served models and their aliases (OpenAI's Models API)
    health.py    GET /healthz (database check) and GET /metrics (Prometheus text), both without a key
    swarm.py     GET /v1/swarm: what the workers last saw of the served models' swarms (for the web view)
"""
