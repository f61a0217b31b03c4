"""Routers of the REST API.

    batches.py   POST/GET /v1/batches, GET /v1/batches/{id}[/results|/errors], POST /v1/batches/{id}/cancel
    health.py    GET /healthz (database check) and GET /metrics (Prometheus text), both without a key
"""
