"""`Settings`: the one typed configuration, read from SWARMBATCH_* environment variables."""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# what the API serves when SWARMBATCH_API_MODELS is unset or empty: the built-in model, never a server path
DEFAULT_API_MODELS = ("smollm2",)
ENV_PREFIX = "SWARMBATCH_"
DISPATCH_BATCH = 8  # requests per process_job task sent for a new job when the worker sizes its own claim


class Settings(BaseSettings):
    """Process-wide settings; CLI flags override them per command."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    home: Path = Field(default=Path.home() / ".swarmbatch", description="embedded state: models, SQLite, broker")
    initial_peers: Annotated[list[str], NoDecode] = Field(default_factory=list,
                                                          description="DHT multiaddrs, comma-separated in env")
    database_url: str | None = Field(default=None, description="the job store's SQLAlchemy URL (PostgreSQL in "
                                     "production); unset: SQLite under SWARMBATCH_HOME")
    broker_url: str | None = Field(default=None, description="the Celery broker (redis://...); unset: an embedded "
                                   "SQLite broker under SWARMBATCH_HOME")

    @field_validator("initial_peers", mode="before")
    @classmethod
    def _split_peers(cls, value: object) -> object:
        if isinstance(value, str):
            return [p for p in value.replace(",", " ").split() if p]
        return value

    checkpoint_every: int = Field(default=8, ge=1, description="commit generated tokens every K tokens")
    worker_batch_size: int | None = Field(default=None, ge=1, description="requests a worker claims and generates "
                                          "together; unset: sized from what the servers can hold (jobs.worker.sizing)")
    pipeline_lanes: int | None = Field(default=None, ge=1, description="micro-batches (sessions) a batch starts with; "
                                       "unset: enough to cover the chain's step time (jobs.worker.sizing)")
    continuous_batching: bool = Field(default=True, description="finished requests leave at once; new ones take "
                                                                 "their slots")
    lease_seconds: float = Field(default=60.0, gt=0, description="a claim expires unless renewed this often")
    max_attempts: int = Field(default=5, ge=1, description="claims of one request before it fails")
    store_retry_seconds: float = Field(default=60.0, gt=0, description="how long a worker retries an unreachable "
                                                                       "database before it stops a batch")
    max_tokens_cap: int = Field(default=4096, ge=1, description="largest max_tokens a request may ask")
    max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1,
                                description="largest accepted input file (OpenAI's limit: 200 MB)")
    max_lines: int = Field(default=50_000, ge=1, description="most lines in one input file (OpenAI's limit)")
    max_concurrent_submissions: int = Field(default=2, ge=1, description="batch submissions one API process "
                                            "stores at once, once their bodies are in; more get 429")
    # per API key, per API process (docs/security.md "API limits"): one key cannot hold what others need
    max_submissions_per_key: int = Field(default=1, ge=1, description="submissions of one API key in progress at "
                                         "once in one API process, from the body's first byte; more get 429")
    max_uploads_per_key: int = Field(default=2, ge=1, description="file uploads of one API key in progress at once "
                                     "in one API process; more get 429")
    max_downloads_per_key: int = Field(default=2, ge=1, description="downloads (file content, batch results and "
                                       "errors) of one API key streaming at once in one API process; more get 429")
    body_deadline_seconds: float = Field(default=300.0, gt=0, description="a request body not received whole "
                                         "this many seconds after its request's head is cut off with 408")
    send_deadline_seconds: float = Field(default=300.0, gt=0, description="a client that takes no more of an answer "
                                         "for this many seconds (one piece of a download, at most 1 MiB, not taken "
                                         "from the server's buffer) loses its connection, and its download slot")
    max_files_per_key: int = Field(default=10_000, ge=1, description="files one API key may keep (as GET /v1/files "
                                   "lists them: uploads, batch inputs, outputs); an upload or submission beyond gets "
                                   "429 insufficient_quota")
    max_stored_bytes_per_key: int = Field(default=10 * 1024 ** 3, ge=1, description="bytes of files one API key may "
                                          "keep (the sum of their `bytes`); an upload or submission beyond gets 429 "
                                          "insufficient_quota")
    upload_retention_seconds: int = Field(default=30 * 24 * 3600, ge=0, description="an API key's uploaded and "
                                          "submitted input files are deleted this long after they are made (a "
                                          "shorter expires_after wins); 0 = kept until deleted")
    output_retention_seconds: int = Field(default=30 * 24 * 3600, ge=0, description="an API key's batch output and "
                                          "error files, and the outputs in the store, are deleted this long after "
                                          "they are made (a shorter output_expires_after wins); 0 = kept until deleted")
    verify_fraction: float = Field(default=0.02, ge=0.0, le=1.0, description="fraction of hop steps a worker "
                                   "recomputes on a second server to catch servers that compute wrong outputs; 0 = off")
    prefill_chunk_tokens: int = Field(default=1024, ge=0, description="a worker sends a prefill of more than this "
                                      "many tokens (rows x prompt length) as steps of at most this many, so that its "
                                      "lanes' prefills take turns on the servers; 0 = each prefill in one step")
    worker_threads: int = Field(default=1, ge=1, description="torch threads per worker pool process")
    sweep_interval: float = Field(default=10.0, gt=0, description="seconds between a worker's maintenance ticks "
                                  "(heartbeat; one sweep per interval across all workers)")
    schedules: Path | None = Field(default=None, description="TOML file of nightly summarization schedules")
    swarm_file: Path | None = Field(default=None, description="a private swarm's members (JSON); unset: open swarm")
    identity: Path | None = Field(default=None, description="the member key the worker's clients prove membership with")
    swarm_snapshot_seconds: float = Field(default=10.0, gt=0, description="a worker publishes what it sees of the "
                                          "swarm (the API's swarm page) at most this often, across all workers")
    schedule_tick: float = Field(default=30.0, gt=0, description="seconds between beat's checks for due schedules")

    api_models: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_API_MODELS),
        description="models (names or paths) a POST /v1/batches may name, comma-separated in env")
    model_aliases: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict, description="other names of served models, e.g. gpt-4o-mini=smollm2,gpt-4o=big "
        "(comma-separated ALIAS=MODEL in env; each MODEL one of api_models): a batch may name a model by its alias")
    metrics_token: SecretStr | None = Field(default=None, description="when set, GET /metrics needs it as a Bearer")
    metrics_cache_seconds: float = Field(default=5.0, ge=0, description="how long a /metrics scrape is reused")

    @field_validator("schedules", "metrics_token", "swarm_file", "identity", "worker_batch_size", "pipeline_lanes",
                     mode="before")
    @classmethod
    def _none_when_empty(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("api_models", mode="before")
    @classmethod
    def _split_models(cls, value: object) -> object:
        if isinstance(value, str):  # commas only: a path may hold spaces
            return [m.strip() for m in value.split(",") if m.strip()] or list(DEFAULT_API_MODELS)
        return value

    @field_validator("model_aliases", mode="before")
    @classmethod
    def _parse_aliases(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        aliases: dict[str, str] = {}
        for entry in (e.strip() for e in value.split(",") if e.strip()):
            alias, equals, model = (part.strip() for part in entry.partition("="))
            if not equals or not alias or not model:
                raise ValueError(f"{entry!r} is not ALIAS=MODEL; write e.g. gpt-4o-mini=smollm2")
            if alias in aliases:
                raise ValueError(f"alias {alias!r} is given twice; give each alias one model")
            aliases[alias] = model
        return aliases

    @model_validator(mode="after")
    def _aliases_name_served_models(self) -> Settings:
        for alias, model in self.model_aliases.items():
            if model not in self.api_models:
                raise ValueError(f"SWARMBATCH_MODEL_ALIASES maps {alias!r} to {model!r}, which SWARMBATCH_API_MODELS "
                                 f"does not list; add it there or drop the alias")
            if alias in self.api_models:
                raise ValueError(f"SWARMBATCH_MODEL_ALIASES: {alias!r} is a served model's own name; an alias must "
                                 f"be another name")
        return self

    def resolve_model(self, name: str) -> str:
        """The served model a name stands for: the model an alias maps to, else the name itself."""
        return self.model_aliases.get(name, name)

    def aliases_of(self, model: str) -> list[str]:
        """The aliases of a served model, in the order SWARMBATCH_MODEL_ALIASES gives them."""
        return [alias for alias, target in self.model_aliases.items() if target == model]

    def tasks_for(self, requests: int) -> int:
        """process_job tasks to send for a new job of `requests` requests: one per expected claim (workers that find
        nothing left to claim return at once), so that several workers start on it together."""
        return math.ceil(requests / (self.worker_batch_size or DISPATCH_BATCH))

    @property
    def resolved_database_url(self) -> str:
        """SWARMBATCH_DATABASE_URL, or SQLite under SWARMBATCH_HOME."""
        return self.database_url or f"sqlite:///{self.home / 'swarmbatch.sqlite'}"

    @property
    def resolved_broker_url(self) -> str:
        """SWARMBATCH_BROKER_URL, or the embedded SQLite broker under SWARMBATCH_HOME."""
        return self.broker_url or f"sqla+sqlite:///{self.home / 'broker.sqlite'}"

    @property
    def models_dir(self) -> Path:
        """Where prepared models are cached."""
        return self.home / "models"


def settings_reference(settings: Settings) -> list[dict[str, Any]]:
    """Every setting: its variable, its value in `settings`, its default and its description (secrets masked)."""
    rows = []
    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        rows.append({"name": name, "env": f"{ENV_PREFIX}{name.upper()}", "value": _shown(getattr(settings, name)),
                     "default": _shown(default), "description": field.description or ""})
    return rows


def _shown(value: object) -> object:
    """A value as `swarmbatch config` shows it: paths as strings, secrets masked."""
    if isinstance(value, SecretStr):
        return "**********"
    if isinstance(value, list):  # as the variable is written
        return " ".join(map(str, value))
    return str(value) if isinstance(value, Path) else value


@lru_cache
def get_settings() -> Settings:
    """The settings of this process, validated once."""
    return Settings()
