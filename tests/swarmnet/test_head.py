"""The client head: one copy of each weight, in the checkpoint's dtype (the LM head float32 on a CPU), CPU in/out."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from swarmnet.head import ClientHead
from swarmnet.model_spec import ModelSpec


def bfloat16_copy(model_dir: Path, out: Path) -> Path:
    """The model with its weights saved as bfloat16 (as most checkpoints on the hub are)."""
    out.mkdir()
    for file in model_dir.iterdir():
        if file.suffix == ".safetensors":
            save_file({k: v.to(torch.bfloat16) for k, v in load_file(file).items()}, out / file.name,
                      metadata={"format": "pt"})
        elif file.is_file():
            (out / file.name).write_bytes(file.read_bytes())
    return out


def test_logits_are_the_models_own_and_the_head_is_held_once(tiny_model: Path) -> None:
    head = ClientHead(ModelSpec.open(tiny_model), device="cpu")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    hidden = torch.randn(3, 2, head.lm_head.in_features, generator=torch.Generator().manual_seed(0)) * 3
    with torch.inference_mode():
        want = F.linear(model.model.norm(hidden), model.lm_head.weight)
        assert torch.equal(head.logits(hidden), want)
        assert torch.equal(head.embed(torch.tensor([[1, 2]])), model.model.embed_tokens(torch.tensor([[1, 2]])))
    assert list(head.buffers()) == []  # no second (transposed) copy of the LM head
    assert sum(p.numel() for p in head.parameters()) == sum(
        p.numel() for p in (model.model.embed_tokens.weight, model.model.norm.weight, model.lm_head.weight))


def test_a_bfloat16_checkpoint_keeps_bfloat16_embeddings_and_a_float32_head_on_the_cpu(tiny_model: Path,
                                                                                        tmp_path: Path) -> None:
    spec = ModelSpec.open(bfloat16_copy(tiny_model, tmp_path / "bf16"))
    head = ClientHead(spec, device="cpu")
    assert (head.embed_tokens.weight.dtype, head.lm_head.weight.dtype) == (torch.bfloat16, torch.float32)
    assert head.embed(torch.tensor([[5]])).dtype == torch.bfloat16  # what the first server is sent
    small = ClientHead(spec, device="cpu", head_dtype=torch.bfloat16)
    assert small.lm_head.weight.dtype == torch.bfloat16
    hidden = torch.randn(2, 1, head.lm_head.in_features, generator=torch.Generator().manual_seed(1))
    logits, small_logits = head.logits(hidden.bfloat16()), small.logits(hidden)
    assert logits.dtype == small_logits.dtype == torch.float32 and logits.device.type == "cpu"
    assert torch.equal(logits.argmax(-1), small_logits.argmax(-1))


def test_a_cuda_head_on_a_machine_without_one_is_refused_in_one_line(tiny_model: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(ValueError, match="torch sees no CUDA GPU here") as refused:
        ClientHead(ModelSpec.open(tiny_model), device="cuda")
    assert "\n" not in str(refused.value)


def tied_copy(model_dir: Path, out: Path) -> Path:
    """The model with its LM head tied to its embeddings (as SmolLM2's): no lm_head.weight in its files."""
    out.mkdir()
    for file in model_dir.iterdir():
        if file.suffix == ".safetensors":
            save_file({k: v for k, v in load_file(file).items() if k != "lm_head.weight"}, out / file.name,
                      metadata={"format": "pt"})
        elif file.name == "config.json":
            (out / file.name).write_text(json.dumps({**json.loads(file.read_text()), "tie_word_embeddings": True}))
        elif file.is_file():
            (out / file.name).write_bytes(file.read_bytes())
    return out


def test_a_ring_servers_head_embeds_as_the_clients_unless_a_tied_head_is_not_float32(tiny_model: Path,
                                                                                  tmp_path: Path) -> None:
    # a ring server's head is float32 (servers/ring.py): untied embeddings keep the checkpoint's dtype on both sides
    assert ClientHead(ModelSpec.open(tiny_model), device="cpu", head_dtype=torch.bfloat16).embeds_as_ring
    tied = ModelSpec.open(tied_copy(tiny_model, tmp_path / "tied"))
    assert ClientHead(tied, device="cpu").embeds_as_ring
    # tied embeddings are the head: in bfloat16, a client would send other bytes than the server's guess
    small = ClientHead(tied, device="cpu", head_dtype=torch.bfloat16)
    assert not small.embeds_as_ring and small.embed(torch.tensor([[5]])).dtype == torch.bfloat16
