"""Errors of the jobs layer.

    JobsError                 root
    ├── JobNotFound           no such job for this API key (HTTP 404)
    ├── FileNotFound          no such file for this API key (HTTP 404)
    ├── InvalidJob            the submission is refused whole (HTTP 400); nothing was created
    ├── IdempotencyConflict   an Idempotency-Key already names another batch of this API key (HTTP 409)
    ├── InsufficientQuota     the API key keeps as many files or bytes as it may (HTTP 429); nothing was stored
    ├── OutputsExpired        a batch's outputs passed their retention and were deleted (HTTP 410)
    ├── JobCancelled          raised inside a worker when its job is being cancelled; not retried
    ├── LeaseLost             a worker's claim expired and another worker took the request over
    ├── StoreUnavailable      the database or broker cannot be reached (exit code 3); retry later
    ├── ApiKeyNotFound        `keys revoke`: no single API key has that id or name (exit code 2)
    └── WorkerGone            the worker a caller waits on has exited; the job is unfinished (exit code 1)
"""
from __future__ import annotations


class JobsError(Exception):
    """Root of job errors."""


class JobNotFound(JobsError):
    """Raised when a job id does not exist or belongs to another API key."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r}; list yours with 'swarmbatch jobs'")


class FileNotFound(JobsError):
    """Raised when a file id does not exist, was deleted, or belongs to another API key."""

    def __init__(self, file_id: str) -> None:
        super().__init__(f"no file {file_id!r}; list yours with GET /v1/files")


class ModelNotFound(JobsError):
    """Raised when a model id is neither served here nor an alias of a served model (GET /v1/models/{id})."""

    param = "model"

    def __init__(self, model_id: str) -> None:
        super().__init__(f"the model {model_id!r} does not exist here; list the models with GET /v1/models")


class InvalidJob(JobsError):
    """Raised when a submission (or a file upload) is refused as a whole; the message says what to fix.

    `param` names the request parameter at fault, when one is (the API's error body carries it).
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class IdempotencyConflict(JobsError):
    """Raised when an idempotency key is reused for a different submission; the first job is kept."""


class InsufficientQuota(JobsError):
    """Raised when an upload or submission would take an API key past its files or bytes quota; nothing is stored."""


class OutputsExpired(JobsError):
    """Raised when a batch's results or errors are read after their retention deleted them."""


class JobCancelled(JobsError):
    """Raised in a worker when the job it works on is being cancelled; the partial output is kept."""


class LeaseLost(JobsError):
    """Raised in a worker whose lease was taken over (it stalled past its lease); it writes nothing more."""


class StoreUnavailable(JobsError):
    """Raised when the database or the broker does not answer; a retry later may succeed."""


class ApiKeyNotFound(JobsError):
    """Raised when no API key, or more than one, matches the id or name an operator gave; nothing changed."""


class WorkerGone(JobsError):
    """Raised to a caller that follows a job on a worker it started, when that worker exits; the job stays resumable."""
