"""The module-level Celery app for Celery's own command line: `celery -A jobs flower`, `celery -A jobs inspect
ping`, `celery -A jobs events` (Celery finds `jobs.celery.app` by itself).

It is the worker's app (jobs.assembly), built from the SWARMBATCH_* settings of this environment; importing this
module builds it and does nothing else (no store is opened, no broker is reached). Run workers with
`swarmbatch worker`, which checks the store and the swarm file first.
"""
from __future__ import annotations

from celery import Celery

from jobs.assembly import get_runtime

app: Celery = get_runtime().celery
