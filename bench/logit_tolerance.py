"""Measure the per-token logit tolerance of half-precision servers (swarmclient/logit_check.py's figures).

For each model and dtype: two block servers (halves of the model) in that dtype on 127.0.0.1, transformers' greedy
continuation of 4 prompts (float32) fed through the swarm's session (prefill, then a decode step a token) and through
transformers in the same dtype; prints the worst relative error per position, the yardstick (transformers in that
dtype against float32 on the same tokens), their ratio, and whether the swarm is within the tolerance.

usage: python bench/logit_tolerance.py [--models tiny,smollm2] [--dtypes float32,bfloat16,float16] [--new-tokens 8]
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from launch.local_swarm import LocalSwarm  # noqa: E402
from modelprep import prepare_model, write_tiny_model  # noqa: E402
from swarmclient.logit_check import check_swarm_logits  # noqa: E402
from swarmclient.textgen import load_tokenizer  # noqa: E402
from swarmnet.model_spec import ModelSpec  # noqa: E402

PROMPTS = ["Hello world, this is", "The quick brown fox jumps over the lazy dog and then", "one two three", "A"]


def model_dir(name: str, tmp: Path) -> Path:
    """tiny: the tests' 6-layer random Llama (seed 1); else what `model prepare` takes (smollm2, a model dir)."""
    if name == "tiny":
        return write_tiny_model(tmp / "tiny", layers=6, seed=1)
    return prepare_model(name, cache_dir=Path(os.environ.get("SWARMBATCH_HOME", Path.home() / ".swarmbatch")) / "models")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="logit-tolerance-") as tmp:
        for name in args.models.split(","):
            path = model_dir(name, Path(tmp))
            blocks = ModelSpec.open(path).num_blocks
            batch = load_tokenizer(path)(PROMPTS, return_tensors="pt", padding=True)
            for dtype in args.dtypes.split(","):
                spans = [(0, blocks // 2), (blocks // 2, blocks)]
                with LocalSwarm(path, spans, server_args=["--dtype", dtype]) as swarm:
                    result = check_swarm_logits(path, batch.input_ids, batch.attention_mask, swarm.initial_peers,
                                                getattr(torch, dtype), new_tokens=args.new_tokens)
                ratio = "" if result.yardstick is None else f", {result.relative / result.yardstick:.2f}x the yardstick"
                print(f"{name} {dtype}: {result.summary()}{ratio}", flush=True)
                print(f"    per position: {result.per_step()}", flush=True)


if __name__ == "__main__":
    main()
