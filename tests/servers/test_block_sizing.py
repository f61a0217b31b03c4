"""A server without --blocks or --num-blocks sizes its span by memory: each block's weights and KV-cache budget,
checked against what a real block holds and what transformers' own cache holds, and one real server sized by
--max-memory-gb."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from launch.local_swarm import LocalSwarm
from modelprep import write_tiny_model
from servers import block_sizing
from servers.block_loading import load_span
from servers.block_sizing import (
    GIB,
    MEMORY_MARGIN,
    BlockFootprint,
    auto_num_blocks,
    block_footprint,
    blocks_that_fit,
    kv_bytes_per_token,
    spare_memory,
)
from servers.config import DType, Quant, ServerConfig
from servers.errors import ServerConfigError
from swarmnet.model_spec import ModelSpec

ARCHS = ["llama", "qwen3", "mixtral", "gemma2", "falcon"]  # plain, own head_dim, experts, eager, multi-query


@pytest.fixture(scope="module")
def family_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            made[arch] = write_tiny_model(tmp_path_factory.mktemp("sizing") / arch, layers=3, arch=arch, seed=5)
        return made[arch]
    return make


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16])
def test_a_blocks_weights_are_what_a_loaded_block_holds(family_model: Callable[[str], Path], arch: str,
                                                        dtype: DType) -> None:
    spec = ModelSpec.open(family_model(arch))
    span = load_span(spec, 1, 2, dtype=dtype)
    held = sum(p.numel() * p.element_size() for p in span.layers.parameters())
    assert block_footprint(spec, dtype, Quant.none, 100).weights == held


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tokens_cache_is_what_transformers_caches_per_layer(family_model: Callable[[str], Path], arch: str) -> None:
    model_dir = family_model(arch)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = 7
    with torch.inference_mode():
        cache = model(torch.arange(tokens)[None] + 3, use_cache=True).past_key_values
    layer = cache.layers[0]
    cached = layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    assert cached == tokens * kv_bytes_per_token(model.config, 4)
    assert block_footprint(ModelSpec.open(model_dir), DType.float32, Quant.none, 1000).cache == 1000 * cached // tokens


def test_blocks_fit_the_memory_less_the_margin_up_to_the_models() -> None:
    footprint = BlockFootprint(weights=900, cache=100)
    assert blocks_that_fit(10_000, footprint, 30) == int(10_000 * (1 - MEMORY_MARGIN)) // 1000 == 9
    assert blocks_that_fit(10 ** 9, footprint, 30) == 30
    assert blocks_that_fit(500, footprint, 30) == 0


def test_the_memory_to_spare_is_the_limit_or_the_free_memory_less_the_blocks_and_the_margin(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, cpu = ModelSpec.open(tiny_model), torch.device("cpu")
    footprint = block_footprint(spec, DType.float32, Quant.none, 1024)
    # --max-memory-gb: the limit less the margin less the loaded blocks' weights and cache budgets
    assert spare_memory(spec, cpu, DType.float32, Quant.none, 1024, 3, max_memory_gb=1.0) == \
        int(GIB * (1 - MEMORY_MARGIN)) - 3 * footprint.total
    assert spare_memory(spec, cpu, DType.float32, Quant.none, 1024, 3, max_memory_gb=1e-6) == 0
    # no limit: the free memory now (the weights already loaded) less the margin and the cache budgets to come
    monkeypatch.setattr(block_sizing, "free_memory", lambda device: 10 * GIB)
    assert spare_memory(spec, cpu, DType.float32, Quant.none, 1024, 3) == \
        int(10 * GIB * (1 - MEMORY_MARGIN)) - 3 * footprint.cache


def test_a_memory_that_holds_no_block_is_one_line_naming_the_ways_out(tiny_model: Path) -> None:
    with pytest.raises(ServerConfigError) as caught:
        auto_num_blocks(ModelSpec.open(tiny_model), torch.device("cpu"), DType.float32, Quant.none, 16384,
                        max_memory_gb=1e-6)
    message = str(caught.value)
    assert message.startswith("not even one block fits: --max-memory-gb 1e-06") and "\n" not in message
    assert "lower --attn-cache-tokens, quantize (--quant), or pass --num-blocks" in message


def test_blocks_and_num_blocks_together_are_refused(tiny_model: Path) -> None:
    with pytest.raises(ServerConfigError, match="pass one of --blocks A:B and --num-blocks N"):
        ServerConfig(str(tiny_model), [], blocks=(0, 2), num_blocks=2)
    ServerConfig(str(tiny_model), [])  # neither: sized by memory


@pytest.mark.swarm  # starts a DHT node and a server
def test_a_server_given_neither_serves_as_many_blocks_as_fit_its_memory_and_says_why(tiny_model: Path,
                                                                                     tmp_path: Path) -> None:
    spec = ModelSpec.open(tiny_model)
    footprint = block_footprint(spec, DType.float32, Quant.none, 1024)
    budget_gb = 2.5 * footprint.total / (1 - MEMORY_MARGIN) / GIB  # two blocks and a half
    with LocalSwarm(tiny_model, [], log_dir=tmp_path) as swarm:
        server = swarm._start_server("auto", [], wait=True, extra_args=[
            "--attn-cache-tokens", "1024", "--max-memory-gb", f"{budget_gb:.9f}"])
        assert server.ready_line.split()[2] == "0:2", server.ready_line  # 'Serving blocks 0:2 of ...'
        log = server.log_path.read_text()
    assert f"Serving 2 of {spec.num_blocks} blocks: --max-memory-gb " in log
    assert "MiB of weights (float32) + " in log and "MiB of KV cache (1024 tokens)" in log
