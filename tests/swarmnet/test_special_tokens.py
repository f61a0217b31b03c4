"""EOS as transformers reads it: config.json, generation_config.json and the tokenizer, united."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from modelprep import write_tiny_model
from servers.block_loading import load_span
from swarmclient.generation import generate_tokens
from swarmclient.sampling import SamplingParams
from swarmclient.textgen import load_tokenizer
from swarmnet.head import ClientHead
from swarmnet.model_spec import ModelSpec

PROMPTS = ["Hello world, this is", "The quick brown fox jumps over the lazy dog and"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("eos") / "tiny", layers=2, seed=5)


def edit_json(file: Path, **changes: object) -> None:
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def spans_generate(spec: ModelSpec, batch: dict, max_new_tokens: int) -> torch.Tensor:
    """Greedy tokens of embeddings -> one local span -> head, stopping at the spec's EOS ids."""
    span = load_span(spec, 0, spec.num_blocks)
    caches = span.new_caches(0, spec.num_blocks)
    return generate_tokens(ClientHead(spec), lambda h, m, p: span(h, m, p, caches).float(), batch["input_ids"],
                           batch["attention_mask"], max_new_tokens=max_new_tokens,
                           params=[SamplingParams()] * len(PROMPTS), eos_token_ids=spec.eos_token_ids,
                           pad_token_id=spec.config.pad_token_id)


def test_eos_ids_are_the_union_of_config_generation_config_and_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    # Given a copy whose three sources each name other EOS ids
    copy = Path(shutil.copytree(model_dir, tmp_path / "copy"))
    edit_json(copy / "config.json", eos_token_id=[2, 7])
    edit_json(copy / "generation_config.json", eos_token_id=[2, 9])
    edit_json(copy / "tokenizer_config.json", eos_token="<|endoftext|>")  # id 0
    # Then the spec stops at all of them
    assert ModelSpec.open(copy).eos_token_ids == {0, 2, 7, 9}
    assert ModelSpec.open(model_dir).eos_token_ids == {2}


def test_an_extra_eos_in_generation_config_stops_generation_as_transformers_does(model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    # Given a Llama-3-Instruct-style dir: generation_config.json lists a second EOS (<|eot_id|> there; here the token
    # the first prompt generates 4th)
    batch = load_tokenizer(model_dir)(PROMPTS, return_tensors="pt", padding=True)
    free = spans_generate(ModelSpec.open(model_dir), batch, 12)
    extra = int(free[0, 3])
    copy = Path(shutil.copytree(model_dir, tmp_path / "instruct"))
    edit_json(copy / "generation_config.json", eos_token_id=[2, extra])
    # When it generates
    got = spans_generate(ModelSpec.open(copy), batch, 12)
    # Then the first row stops at that token (pads after it), as transformers' generate does
    stop = free[0].tolist().index(extra)
    assert stop <= 3 and (got[0, stop + 1:] == 2).all() and not (free[0, stop + 1:] == 2).all()
    reference = AutoModelForCausalLM.from_pretrained(copy).eval()
    with torch.inference_mode():
        expected = reference.generate(**batch, max_new_tokens=12, do_sample=False)[:, batch["input_ids"].shape[1]:]
    assert torch.equal(got, expected)
