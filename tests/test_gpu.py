"""CUDA checks (`pytest -m gpu`; skipped without a GPU): scripts/gpu-check.sh runs them and prints their table.

Each test appends its row to the JSON-lines file named by SWARMBATCH_GPU_REPORT (when set): the check, its result
and the figures. Tolerances: float32 servers give the same greedy tokens as transformers on the same GPU; bfloat16
and float16 servers give teacher-forced per-token logits (transformers' greedy tokens fed through the swarm's
session: a prefill, then one decode step a token) within swarmclient.logit_check's tolerance of transformers' logits
in the same dtype on the same GPU: the worst token's ||got - want|| / ||want|| at most 2x transformers' own error in
that dtype against float32, and the same top-1 wherever the margin decides it (tests/test_logit_check.py runs the
same check on the CPU); int8 / nf4 servers answer within QUANT_TOLERANCE.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from launch.local_swarm import LocalSwarm
from modelprep.tiny import write_tiny_model
from swarmclient.logit_check import check_swarm_logits
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.swarm import Swarm
from swarmclient.textgen import load_tokenizer
from swarmnet.model_spec import ModelSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

PROMPTS = ["Hello world, this is", "The quick brown fox jumps over the lazy dog and then", "one two three", "A"]
QUANT_TOLERANCE = 0.3
JOB_ROWS, JOB_TOKENS = 64, 32


def report(check: str, ok: bool, detail: str) -> None:
    """One row of gpu-check.sh's table."""
    path = os.environ.get("SWARMBATCH_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"check": check, "ok": ok, "detail": detail}) + "\n")


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 8-layer Llama of hidden size 512 (big enough for the GPU to matter, small enough to write fast)."""
    return write_tiny_model(tmp_path_factory.mktemp("gpu") / "llama-512", layers=8, hidden_size=512, seed=3)


def start(local_swarm, model_dir: Path, *args: str) -> LocalSwarm:
    swarm = local_swarm(model_dir, [])
    swarm.start_servers([(0, 4, ["--device", "cuda", *args]), (4, 8, ["--device", "cuda", *args])])
    return swarm


def local_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()


def test_greedy_tokens_through_two_float32_gpu_servers_equal_transformers_on_the_gpu(gpu_model: Path,
                                                                                    local_swarm) -> None:
    swarm = start(local_swarm, gpu_model, "--dtype", "float32")
    batch = load_tokenizer(gpu_model)(PROMPTS, return_tensors="pt", padding=True)
    with torch.inference_mode():
        want = local_model(gpu_model).generate(**batch.to("cuda"), max_new_tokens=24, do_sample=False).cpu()
    with DistributedModelForCausalLM.from_pretrained(gpu_model, initial_peers=swarm.initial_peers) as model:
        assert model.head.device.type == "cuda"
        got = model.generate(batch.input_ids.cpu(), batch.attention_mask.cpu(), max_new_tokens=24)
    same = torch.equal(got, want)
    report("greedy tokens, 2 GPU servers float32 = transformers float32 (same GPU)", same,
           f"{int((got == want).all(1).sum())}/{len(PROMPTS)} rows identical, 24 tokens")
    assert same


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpu_servers_give_teacher_forced_logits_within_tolerance_of_transformers_in_their_dtype(
        gpu_model: Path, local_swarm, dtype: str) -> None:
    swarm = start(local_swarm, gpu_model, "--dtype", dtype)
    batch = load_tokenizer(gpu_model)(PROMPTS, return_tensors="pt", padding=True)
    result = check_swarm_logits(gpu_model, batch.input_ids, batch.attention_mask, swarm.initial_peers,
                                getattr(torch, dtype), new_tokens=16, device="cuda")
    report(f"per-token logits (teacher-forced), 2 GPU servers {dtype} vs transformers {dtype} (same GPU)", result.ok,
           f"{result.summary()}; per position: {result.per_step()}")
    assert result.ok, result.summary()


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_quantized_gpu_servers_answer_close_to_float32(gpu_model: Path, local_swarm, quant: str) -> None:
    swarm = local_swarm(gpu_model, [])
    swarm.start_servers([(0, 8, ["--device", "cuda", "--dtype", "float32"]), (0, 8, ["--device", "cuda", "--quant", quant])])
    spec = ModelSpec.open(gpu_model)
    hidden = torch.randn(2, 6, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    inputs = [hidden, torch.ones(2, 6, dtype=torch.long), torch.arange(6).expand(2, 6)]
    client = Swarm.connect(swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks)
    try:
        exact, approx = (client.loop.run(client.forward_hidden(server.peer_id, 0, 8, *inputs)).float()
                         for server in swarm.servers)
    finally:
        client.close()
    error = float((approx - exact).norm() / exact.norm())
    ok = bool(torch.isfinite(approx).all()) and error < QUANT_TOLERANCE
    report(f"{quant} GPU server answers", ok, f"relative error vs float32 {error:.3f} (limit {QUANT_TOLERANCE})")
    assert ok


def test_a_64_request_batch_through_two_gpu_servers_against_local_generate(gpu_model: Path, local_swarm) -> None:
    swarm = start(local_swarm, gpu_model, "--max-batch-size", str(JOB_ROWS))
    tokenizer = load_tokenizer(gpu_model)
    batch = tokenizer([f"Request {i}: {PROMPTS[i % len(PROMPTS)]}" for i in range(JOB_ROWS)], return_tensors="pt",
                      padding=True)
    model = AutoModelForCausalLM.from_pretrained(gpu_model).to("cuda").eval()  # the checkpoint's dtype, as servers
    with torch.inference_mode():
        model.generate(**batch.to("cuda"), max_new_tokens=2, do_sample=False)  # warm-up
        torch.cuda.synchronize()
        began = time.perf_counter()
        local = model.generate(**batch.to("cuda"), max_new_tokens=JOB_TOKENS, min_new_tokens=JOB_TOKENS,
                               do_sample=False)
        torch.cuda.synchronize()
        local_rate = JOB_ROWS * JOB_TOKENS / (time.perf_counter() - began)
    del model
    with DistributedModelForCausalLM.from_pretrained(gpu_model, initial_peers=swarm.initial_peers) as remote:
        ids, mask = batch.input_ids.cpu(), batch.attention_mask.cpu()
        remote.generate(ids, mask, max_new_tokens=2)  # warm-up: routes, sessions, kernels
        began = time.perf_counter()
        got = remote.generate_new_tokens(ids, mask, max_new_tokens=JOB_TOKENS,
                                         params=remote.sampling_params(JOB_ROWS, False, 1.0, 1.0, 0))
        swarm_rate = got.numel() / (time.perf_counter() - began)
    report(f"{JOB_ROWS} requests x {JOB_TOKENS} tokens, tok/s: 2 GPU servers vs local generate b{JOB_ROWS}",
           got.shape[0] == JOB_ROWS and local.shape[0] == JOB_ROWS,
           f"swarm {swarm_rate:.0f} tok/s, local {local_rate:.0f} tok/s ({swarm_rate / local_rate:.2f}x)")
    assert got.shape[0] == JOB_ROWS and swarm_rate > 0
