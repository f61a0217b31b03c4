"""A model cut into spans computes what the whole model computes (in one process, every supported family)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from modelprep import write_tiny_model
from servers.block_loading import load_span
from servers.config import DType
from servers.errors import ServerConfigError
from swarmclient.generation import generate_tokens
from swarmclient.sampling import SamplingParams
from swarmclient.textgen import load_tokenizer
from swarmnet.errors import ModelDirError
from swarmnet.families import FAMILIES
from swarmnet.head import ClientHead
from swarmnet.model_spec import ModelSpec

PROMPTS = ["Hello world, this is", "A", "The quick brown fox jumps over the lazy dog and", "one two"]


def local_chain(spans: list, caches: list) -> object:
    def step(hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        for span, cache in zip(spans, caches, strict=True):
            hidden = span(hidden, mask, positions, cache).float()
        return hidden
    return step


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_spans_generate_the_same_tokens_as_transformers(arch: str, tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / arch, layers=4, arch=arch, seed=3)
    spec = ModelSpec.open(model_dir)
    tokenizer = load_tokenizer(model_dir)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        expected = reference.generate(**batch, max_new_tokens=24, do_sample=False)[:, batch.input_ids.shape[1]:]
    spans = [load_span(spec, 0, 1), load_span(spec, 1, 4)]
    caches = [s.new_caches(s.start, s.end) for s in spans]
    got = generate_tokens(ClientHead(spec), local_chain(spans, caches), batch.input_ids, batch.attention_mask,
                          max_new_tokens=24, params=[SamplingParams()] * len(PROMPTS),
                          eos_token_ids={spec.config.eos_token_id}, pad_token_id=spec.config.pad_token_id)
    assert torch.equal(got, expected)


def test_a_span_can_run_any_sub_range_of_its_blocks(tiny_model: Path) -> None:
    spec = ModelSpec.open(tiny_model)
    whole, first, second = load_span(spec, 0, 6), load_span(spec, 0, 2), load_span(spec, 2, 6)
    hidden = torch.randn(2, 5, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 5, dtype=torch.long)
    positions = torch.arange(5).expand(2, 5)
    via_parts = second(first(hidden, mask, positions), mask, positions)
    via_sub_ranges = whole(whole(hidden, mask, positions, start=0, end=2), mask, positions, start=2, end=6)
    assert torch.equal(via_parts, via_sub_ranges)


def test_a_span_loads_only_its_own_blocks(tmp_path: Path) -> None:
    # Given a sharded model with its manifest, from which the shards holding only blocks 4-5 are deleted
    model_dir = write_tiny_model(tmp_path / "sharded", layers=6, seed=2, shard_size="60KB", manifest=True)
    spec = ModelSpec.open(model_dir)
    late = ("model.layers.4.", "model.layers.5.")
    files = set(spec.tensor_index.values())
    only_late = [f for f in files if all(n.startswith(late) for n, g in spec.tensor_index.items() if g == f)]
    assert only_late, "the shards should separate late blocks"
    for file in only_late:
        file.unlink()
    spec = ModelSpec.open(model_dir)
    # When a server loads blocks 0:4, Then it works without the deleted files
    span = load_span(spec, 0, 4)
    assert sum(p.numel() for p in span.parameters()) == 4 * sum(p.numel() for p in span.layers[0].parameters())
    # and a span that needs them fails with one line naming a missing file
    with pytest.raises(ModelDirError, match=rf"lacks {min(f.name for f in only_late)}, which holds") as err:
        load_span(spec, 0, 6)
    assert len(str(err.value).splitlines()) == 1


def test_a_bfloat16_span_stays_close_to_float32(tiny_model: Path) -> None:
    spec = ModelSpec.open(tiny_model)
    hidden = torch.randn(1, 4, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    mask, positions = torch.ones(1, 4, dtype=torch.long), torch.arange(4)[None]
    exact = load_span(spec, 0, 6)(hidden, mask, positions)
    half = load_span(spec, 0, 6, dtype=DType.bfloat16)(hidden, mask, positions)
    assert half.dtype == torch.bfloat16
    assert (half.float() - exact).abs().max() / exact.abs().max() < 0.05


def test_blocks_outside_the_model_are_refused(tiny_model: Path) -> None:
    with pytest.raises(ServerConfigError, match="outside the model"):
        load_span(ModelSpec.open(tiny_model), 4, 9)


def test_a_falcon_variant_we_cannot_run_is_refused_with_one_line(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "falcon", layers=1, arch="falcon")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "alibi": True}))
    with pytest.raises(ModelDirError, match=r"falcon with alibi=True is not supported") as err:
        ModelSpec.open(model_dir)
    assert len(str(err.value).splitlines()) == 1
