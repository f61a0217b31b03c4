"""Teacher-forced per-token logits through real servers (swarmclient/logit_check.py): in bfloat16 and float16 the
swarm's logits are within the stated tolerance of transformers' in the same dtype at every position (greedy tokens
are the check in float32 only: a random model's flat logits flip at one rounding step), and the check has teeth: the
same swarm's logits are outside it against a copy of the model with one weight moved."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from swarmclient.config import ClientConfig
from swarmclient.logit_check import (
    YARDSTICK_MULTIPLE,
    LogitComparison,
    check_swarm_logits,
    compare_logits,
    swarm_logits,
    teacher_forced_reference,
)
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.textgen import load_tokenizer

PROMPTS = ["Hello world, this is", "The quick brown fox jumps over the lazy dog and then", "one two three", "A"]
NEW_TOKENS = 8


def prompts(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    batch = load_tokenizer(model_dir)(PROMPTS, return_tensors="pt", padding=True)
    return batch.input_ids, batch.attention_mask


def assert_decided(result: LogitComparison) -> None:
    """Every step compared, and the top-1 check not vacuous: most positions have a margin that decides it."""
    agreed, checked = result.top1
    assert len(result.steps) == 1 + NEW_TOKENS
    assert checked >= 20 and agreed == checked, result.summary()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_two_servers_give_teacher_forced_logits_within_tolerance_of_transformers_in_their_dtype(
        tiny_model: Path, local_swarm, dtype: str) -> None:
    swarm = local_swarm(tiny_model, [])
    swarm.start_servers([(0, 3, ["--dtype", dtype]), (3, 6, ["--dtype", dtype])])
    result = check_swarm_logits(tiny_model, *prompts(tiny_model), swarm.initial_peers, getattr(torch, dtype),
                                new_tokens=NEW_TOKENS)
    assert result.ok and result.relative <= result.tolerance, result.summary()
    assert_decided(result)
    if dtype != "float32":  # the limit is the stated multiple of transformers' own error in this dtype
        assert result.yardstick is not None and result.tolerance == pytest.approx(YARDSTICK_MULTIPLE * result.yardstick)
        assert 0 < result.relative < result.yardstick * YARDSTICK_MULTIPLE


def moved_copy(model_dir: Path, out: Path, name: str, by: float) -> Path:
    """A copy of the model with one weight (the first element of tensor `name`) moved by `by`."""
    shutil.copytree(model_dir, out)
    tensors = load_file(out / "model.safetensors")
    tensors[name].view(-1)[0] += by
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_the_logit_check_fails_against_a_model_with_one_weight_moved(tiny_model: Path, local_swarm,
                                                                     tmp_path: Path) -> None:
    swarm = local_swarm(tiny_model, [(0, 3), (3, 6)], server_args=["--dtype", "bfloat16"])
    ids, mask = prompts(tiny_model)
    forced = teacher_forced_reference(tiny_model, ids, mask, torch.bfloat16, new_tokens=NEW_TOKENS)
    config = ClientConfig(device="cpu", head_dtype="bfloat16")
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers,
                                                     config=config) as model:
        got = swarm_logits(model, forced)
    assert compare_logits(got, forced).ok
    # block 2's attention output, one weight of ~0.02 moved by 0.1: the same token sequence, other logits
    moved = moved_copy(tiny_model, tmp_path / "moved", "model.layers.2.self_attn.o_proj.weight", 0.1)
    against_moved = compare_logits(got, teacher_forced_reference(moved, ids, mask, torch.bfloat16,
                                                                  continuation=forced.input_ids[:, ids.shape[1]:]))
    assert not against_moved.ok and against_moved.relative > 2 * against_moved.tolerance, against_moved.summary()
