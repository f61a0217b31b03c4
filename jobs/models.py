"""SQL models: the truth about every job and request, including the generated token ids (the checkpoint)."""
from __future__ import annotations

import re
from datetime import UTC, datetime
from enum import Enum, StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy import Enum as SQLEnum
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    """Timezone-aware now (stored as UTC)."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (SQLite hands back naive values otherwise)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC)
            if dialect.name == "sqlite":  # stored as text: keep one naive UTC format so comparisons hold
                value = value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


class ExactText(TypeDecorator[str]):
    """Text that holds any Python string on every backend: PostgreSQL's text refuses NUL characters (a model can
    write one: byte-level tokenizers have a token for every byte), so there NUL is stored escaped as U+E000 U+E002,
    and U+E000 itself as U+E000 U+E001. The escape is undone on reading, so what a model wrote reads back exactly."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        if value is None or dialect.name != "postgresql" or not ("\x00" in value or _ESCAPE in value):
            return value
        return value.replace(_ESCAPE, _ESCAPE + "\ue001").replace("\x00", _ESCAPE + "\ue002")

    def process_result_value(self, value: str | None, dialect: Dialect) -> str | None:
        if value is None or dialect.name != "postgresql" or _ESCAPE not in value:
            return value
        return _ESCAPED.sub(lambda m: _ESCAPE if m.group(1) == "\ue001" else "\x00", value)


_ESCAPE = "\ue000"  # a private-use character: the escape of ExactText
_ESCAPED = re.compile("\ue000([\ue001\ue002])")


class Base(DeclarativeBase):
    """Declarative base; `migrations/` targets its metadata."""

    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, datetime: UTCDateTime()}


class JobStatus(StrEnum):
    """OpenAI Batch API statuses: a stored job is `validating` until a worker claims its first requests."""

    validating = "validating"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    failed = "failed"
    cancelling = "cancelling"
    cancelled = "cancelled"
    expired = "expired"

    @property
    def terminal(self) -> bool:
        """No further work will happen."""
        return self in (JobStatus.completed, JobStatus.failed, JobStatus.cancelled, JobStatus.expired)


class JobKind(StrEnum):
    """What a job is for: it picks the lifecycle hooks (jobs.lifecycle) that run when the job moves."""

    batch = "batch"      # a user's batch (API or CLI): nothing beyond the requests
    summary = "summary"  # a schedule's run (jobs.summaries): map-reduce stages, then Markdown pages


class RequestStatus(StrEnum):
    """One prompt's lifecycle."""

    pending = "pending"          # waiting for a worker (also after a lease expired)
    in_progress = "in_progress"  # claimed under a lease
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"
    expired = "expired"

    @property
    def terminal(self) -> bool:
        """No worker will touch it again."""
        return self not in (RequestStatus.pending, RequestStatus.in_progress)


def status_column(enum: type[Enum]) -> SQLEnum:
    """A status (or kind) column: the member's value as VARCHAR(20), the very strings and schema of migration 0001."""
    # non-native and without a CHECK constraint, so the schema needs no migration; binding or loading a string
    # that is no member raises
    return SQLEnum(enum, native_enum=False, create_constraint=False, length=20, validate_strings=True,
                   values_callable=lambda members: [m.value for m in members])


class ApiKey(Base):
    """A bearer key; only its sha256 is stored."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]  # set by `swarmbatch keys revoke`: the key authenticates nothing from then on


class Job(Base):
    """A batch: one input file, many requests."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id"), index=True)
    model: Mapped[str] = mapped_column(String(500))
    endpoint: Mapped[str] = mapped_column(String(40))
    status: Mapped[JobStatus] = mapped_column(status_column(JobStatus), default=JobStatus.validating, index=True)
    kind: Mapped[JobKind] = mapped_column(status_column(JobKind), default=JobKind.batch)
    input_filename: Mapped[str | None] = mapped_column(String(500))
    # the Files API's ids (jobs.files): the input (None for a summary job), and the output and error files made
    # when the job ended (None while it runs, and when there is nothing to put in them)
    input_file_id: Mapped[str | None] = mapped_column(String(40))
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    line_errors: Mapped[list[Any]] = mapped_column(default=list)
    blocked_reason: Mapped[str | None] = mapped_column(ExactText)
    checkpoint_every: Mapped[int] = mapped_column(Integer, default=8)
    completion_window_s: Mapped[int] = mapped_column(Integer, default=24 * 3600)
    idempotency_key: Mapped[str | None] = mapped_column(String(300), unique=True)
    # sha256 of what was submitted under an API Idempotency-Key: the same key with another batch is a conflict
    idempotency_fingerprint: Mapped[str | None] = mapped_column(String(64))
    # the user's metadata (OpenAI's shape: at most 16 string pairs), shown back and never read by the service,
    # which keeps its own state in columns (`kind`, the summary run)
    metadata_json: Mapped[dict[str, Any]] = mapped_column("metadata", default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]
    in_progress_at: Mapped[datetime | None]
    finalizing_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    cancelling_at: Mapped[datetime | None]
    cancelled_at: Mapped[datetime | None]
    expired_at: Mapped[datetime | None]
    # no new process_job chain is dispatched by a sweep before this time: one is scheduled (a blocked job's
    # backoff) or was just sent; so a job has one pending chain, however many sweeps run
    dispatch_after: Mapped[datetime | None]
    # checked outputs (SWARMBATCH_VERIFY_FRACTION): hop steps recomputed on a second server, those whose outputs
    # differed (a server was banned), and sampled ones no second server could recompute
    steps_verified: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    verification_mismatches: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    steps_unverified: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # per worker (name), the batch it runs now: {"claim", "lanes", "bound"} (jobs.worker.sizing), for `status`
    pipeline: Mapped[dict[str, Any]] = mapped_column(default=dict, server_default="{}")
    # retention (jobs.retention): the output and error files expire this long after they are made (None: kept);
    # when they did, the outputs were deleted from the requests too, and the results and errors read 410
    output_expires_after_s: Mapped[int | None] = mapped_column(Integer)
    outputs_expired_at: Mapped[datetime | None]
    # validation of the input's lines off the request (jobs.ingest): the byte offset in the input file where it goes
    # on, and the number of the last line it read; None once every line is checked (or when they were checked at
    # submission): only then do workers take the job's requests
    ingest_offset: Mapped[int | None] = mapped_column(BigInteger)
    ingest_line: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    requests: Mapped[list[Request]] = relationship(back_populates="job", order_by="Request.index",
                                                   cascade="all, delete-orphan")
    summary: Mapped[SummaryRun | None] = relationship(back_populates="job", cascade="all, delete-orphan")


class Request(Base):
    """One prompt of a job; `generated_ids` is committed every K tokens and is where a resume starts."""

    __tablename__ = "requests"
    __table_args__ = (
        UniqueConstraint("job_id", "custom_id", "choice", name="uq_requests_job_custom_id_choice"),
        Index("ix_requests_job_status", "job_id", "status"),
        # covers GET /metrics' one query over requests (counts and tokens by status): read without the rows
        Index("ix_requests_status_generated_count", "status", "generated_count"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)          # 0-based position among the job's requests (input order)
    line_number: Mapped[int] = mapped_column(Integer)    # 1-based line in the input file
    custom_id: Mapped[str] = mapped_column(String(500))
    # which of its line's `n` choices this request generates (0 for n = 1); a line's choices are consecutive
    # requests, each with a seed of its own (jobs.store.choice_seed), joined again into one response (jobs.outputs)
    choice: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    body: Mapped[dict[str, Any]] = mapped_column()
    prompt_ids: Mapped[list[Any]] = mapped_column()
    # len(prompt_ids), written with it: a batch's usage sums this instead of parsing every row's JSON
    prompt_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    max_tokens: Mapped[int] = mapped_column(Integer)
    temperature: Mapped[float] = mapped_column(default=0.0)
    top_p: Mapped[float] = mapped_column(default=1.0)
    seed: Mapped[int] = mapped_column(BigInteger, default=0)
    stop: Mapped[list[Any]] = mapped_column(default=list)
    # logprobs asked (OpenAI's chat `top_logprobs`, or completions' `logprobs`): None for none, else how many of the
    # most likely tokens to report with each generated one
    top_logprobs: Mapped[int | None] = mapped_column(Integer)
    status: Mapped[RequestStatus] = mapped_column(status_column(RequestStatus), default=RequestStatus.pending)
    generated_ids: Mapped[list[Any]] = mapped_column(default=list)
    # with top_logprobs: one entry per generated id, [token text, logprob, [[text, logprob], ...]], committed with them
    generated_logprobs: Mapped[list[Any] | None] = mapped_column(JSON)
    # len(generated_ids), written with it by the store: totals sum this instead of parsing every row's JSON
    generated_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    finish_reason: Mapped[str | None] = mapped_column(String(20))
    # a /v1/embeddings request's vector once computed: float32 values, little-endian (what OpenAI's base64 encodes)
    embedding: Mapped[bytes | None] = mapped_column(LargeBinary)
    output_text: Mapped[str | None] = mapped_column(ExactText)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(ExactText)
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_token: Mapped[str | None] = mapped_column(String(40))
    lease_expires_at: Mapped[datetime | None]
    # summarization jobs: the source document, its map-reduce stage (0 = the document or its chunks,
    # n = summaries of stage n-1), and whether this request's output is the document's summary
    document: Mapped[str | None] = mapped_column(String(1000))
    stage: Mapped[int] = mapped_column(Integer, default=0)
    final: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]

    job: Mapped[Job] = relationship(back_populates="requests")


class FilePurpose(StrEnum):
    """What a file is for (OpenAI's purposes): an uploaded batch input, or a job's output or error lines."""

    batch = "batch"
    batch_output = "batch_output"


class StoredFile(Base):
    """A file of the Files API. An upload's bytes are its FileChunk rows; a job's output or error file holds no
    bytes: it is rendered from the job's requests when read (jobs.files), and `bytes` was counted when it was made."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_api_key_created", "api_key_id", "created_at"),
                      Index("ix_files_expires_at", "expires_at"))

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id"))
    purpose: Mapped[FilePurpose] = mapped_column(status_column(FilePurpose))
    filename: Mapped[str] = mapped_column(String(500))
    size: Mapped[int] = mapped_column("bytes", BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # an output or error file: the job it renders, and which of its two line streams
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    lines: Mapped[str | None] = mapped_column(String(10))  # "output" | "error"
    # OpenAI's expires_at: the sweep deletes the file after it (jobs.retention); None: kept until deleted
    expires_at: Mapped[datetime | None]


class FileChunk(Base):
    """One piece of an uploaded file's bytes, in order (a file is stored in pieces, so none is one huge value)."""

    __tablename__ = "file_chunks"

    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class SummaryRun(Base):
    """A summary job's own state: which schedule and period it runs, where its pages go, and whether they went.

    Everything here comes from the operator's schedules file (at firing) or from the service, never from a user.
    """

    __tablename__ = "summary_runs"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    schedule: Mapped[str] = mapped_column(String(200))
    period: Mapped[str] = mapped_column(String(100))
    model_id: Mapped[str] = mapped_column(String(500))      # the model and its weights revision
    template_sha: Mapped[str] = mapped_column(String(64))   # Schedule.template_sha at firing
    output_dir: Mapped[str] = mapped_column(String(2000))   # Schedule.output_dir at firing: the pages go here
    shape: Mapped[dict[str, Any]] = mapped_column()          # SummaryShape: how later map-reduce stages prompt
    documents: Mapped[list[Any]] = mapped_column()           # [{"key", "source", "sha", "action": summarize|skip}]
    skipped: Mapped[int] = mapped_column(Integer, default=0)  # unchanged documents not summarized again
    # the pages: written once the job ends; a failed write is recorded and retried by sweeps, a bounded number of
    # times (jobs.summaries.pages)
    pages_written_at: Mapped[datetime | None]
    pages_attempts: Mapped[int] = mapped_column(Integer, default=0)
    pages_error: Mapped[str | None] = mapped_column(ExactText)
    pages_retry_at: Mapped[datetime | None]                  # the next try; None: written, or given up

    job: Mapped[Job] = relationship(back_populates="summary")


class DocumentSummary(Base):
    """The last successful summary of one document by one schedule: what an unchanged document is skipped by."""

    __tablename__ = "document_summaries"
    __table_args__ = (UniqueConstraint("schedule", "document", name="uq_document_summaries_schedule_document"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    schedule: Mapped[str] = mapped_column(String(200))
    document: Mapped[str] = mapped_column(String(1000))
    content_sha: Mapped[str] = mapped_column(String(64))
    model_id: Mapped[str] = mapped_column(String(500))
    template_sha: Mapped[str] = mapped_column(String(64))
    summary: Mapped[str] = mapped_column(ExactText)
    output_path: Mapped[str] = mapped_column(String(2000))
    job_id: Mapped[str] = mapped_column(String(40))
    summarized_at: Mapped[datetime] = mapped_column(default=utcnow)


class WorkerHeartbeat(Base):
    """A live worker process: written every maintenance tick, deleted on a clean stop."""

    __tablename__ = "worker_heartbeats"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    started_at: Mapped[datetime]
    last_seen: Mapped[datetime]
    expires_at: Mapped[datetime]  # alive until then: a few of its ticks, so a slow tick is not a death


class MaintenanceSlot(Base):
    """When a periodic duty (the sweep) is next due; the worker that moves `next_at` on does it this time."""

    __tablename__ = "maintenance_slots"

    name: Mapped[str] = mapped_column(String(40), primary_key=True)
    next_at: Mapped[datetime]


class SwarmSnapshot(Base):
    """What a worker last saw of one model's swarm (the coverage map of jobs.worker.swarm_view), for the API's
    swarm page: the API never joins the swarm. One row per model, overwritten by whichever worker saw it last."""

    __tablename__ = "swarm_snapshots"

    model: Mapped[str] = mapped_column(String(500), primary_key=True)  # a job's model, as submitted
    worker: Mapped[str] = mapped_column(String(200))
    taken_at: Mapped[datetime]
    report: Mapped[dict[str, Any]]
