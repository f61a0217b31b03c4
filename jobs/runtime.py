"""`Runtime`: the collaborators of one process — settings, database, Celery app, lifecycle, swarm clients, tokenizers.

The runtime is built with what the core must not import itself: each job kind's hooks and the Celery app the
process runs. jobs.assembly passes the real ones (`build_runtime`); the core only calls them.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from celery import Celery
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from jobs.db import make_engine, make_session_factory
from jobs.errors import StoreUnavailable
from jobs.lifecycle import JobHooks, Lifecycle
from jobs.models import JobKind
from jobs.settings import Settings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from swarmclient.config import ClientConfig
    from swarmclient.model import DistributedModelForCausalLM
    from swarmnet.membership import SwarmAccess

logger = logging.getLogger(__name__)

HooksFactory = Callable[["Runtime"], Mapping[JobKind, JobHooks]]  # each job kind's hooks, given the runtime
CeleryFactory = Callable[["Runtime"], Celery]  # the Celery app this process sends (and, in a worker, runs) tasks with


@dataclass
class Runtime:
    """Lazily built collaborators of one process; workers build swarm clients after the fork."""

    settings: Settings
    make_hooks: HooksFactory
    make_celery: CeleryFactory
    _models: dict[str, DistributedModelForCausalLM] = field(default_factory=dict)
    _tokenizers: dict[str, PreTrainedTokenizerBase] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @cached_property
    def engine(self) -> Engine:
        """The database engine."""
        return make_engine(self.settings)

    @cached_property
    def sessions(self) -> sessionmaker[Session]:
        """Session factory."""
        return make_session_factory(self.engine)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that is closed afterwards; the caller commits."""
        with self.sessions() as session:
            yield session

    @cached_property
    def celery(self) -> Celery:
        """The Celery app."""
        return self.make_celery(self)

    @cached_property
    def lifecycle(self) -> Lifecycle:
        """Job transitions with every kind's hooks registered: the one way any caller changes a job's status."""
        return Lifecycle(self.make_hooks(self))

    @cached_property
    def access(self) -> SwarmAccess:
        """The swarm's membership and this process's member key (SWARMBATCH_SWARM_FILE, SWARMBATCH_IDENTITY)."""
        from swarmnet.membership import SwarmAccess

        return SwarmAccess.load(self.settings.swarm_file, self.settings.identity)

    @property
    def worker_name(self) -> str:
        """host:pid, for lease owners and logs."""
        return worker_name_of(os.getpid())

    def check_store(self) -> None:
        """Raise StoreUnavailable unless the database answers and is migrated."""
        try:
            with self.engine.connect() as connection:
                connection.execute(text("SELECT count(*) FROM jobs"))
        except DBAPIError as e:
            raise StoreUnavailable(f"database {self.engine.url.render_as_string(hide_password=True)} is not usable "
                                   f"({str(e.orig).strip().splitlines()[0]}); start it and run "
                                   "'swarmbatch db upgrade'") from e

    def ensure_store(self) -> None:
        """Embedded SQLite migrates itself on first use; any other database must answer and be migrated."""
        if self.settings.resolved_database_url.startswith("sqlite"):
            from jobs.migrate import upgrade

            self.settings.home.mkdir(parents=True, exist_ok=True)
            # processes starting together (the demo and its worker, an api beside a worker) migrate one at a time:
            # two upgrades of a new file at once fail with "table ... already exists"
            with open(self.settings.home / ".migrate.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                upgrade(self.settings.resolved_database_url)
        self.check_store()

    def model_dir(self, model: str) -> Path:
        """A job's model name or path -> its prepared directory."""
        from modelprep import prepare_model

        return prepare_model(model, cache_dir=self.settings.models_dir)

    def tokenizer(self, model: str) -> PreTrainedTokenizerBase:
        """The model's tokenizer (cached)."""
        from swarmclient.textgen import load_tokenizer

        with self._lock:
            if model not in self._tokenizers:
                self._tokenizers[model] = load_tokenizer(self.model_dir(model))
            return self._tokenizers[model]

    def swarm_model(self, model: str) -> DistributedModelForCausalLM:
        """A DistributedModelForCausalLM joined to the swarm (cached per process: a server it bans for wrong outputs
        stays banned for every later job of this process)."""
        from swarmclient.model import DistributedModelForCausalLM

        with self._lock:
            if model not in self._models:
                self._models[model] = DistributedModelForCausalLM.from_pretrained(
                    self.model_dir(model), initial_peers=self.settings.initial_peers, access=self.access,
                    config=self.client_config())
            return self._models[model]

    def client_config(self) -> ClientConfig:
        """The swarm client's knobs that the settings set (checked outputs, chunked prefills)."""
        from swarmclient.config import ClientConfig

        return ClientConfig(verify_fraction=self.settings.verify_fraction,
                            prefill_chunk_tokens=self.settings.prefill_chunk_tokens or None)

    def close(self) -> None:
        """Leave the swarm and dispose of the engine."""
        for model in self._models.values():
            model.close()
        self._models.clear()
        if "engine" in self.__dict__:
            self.engine.dispose()


def worker_name_of(pid: int) -> str:
    """The lease owner name of process `pid` on this machine (what its Runtime.worker_name says)."""
    return f"{socket.gethostname()}:{pid}"


def local_pid_of(owner: str) -> int | None:
    """The process id a lease owner name gives, if it names a process of this machine (worker_name_of's inverse)."""
    host, _, pid = owner.rpartition(":")
    return int(pid) if host == socket.gethostname() and pid.isdigit() else None
