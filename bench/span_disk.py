"""Benchmark: what each box must hold (issue 27, "Only your span on disk") and what the model id costs there.

Writes a sharded checkpoint with its manifest (a tiny random Llama, or SmolLM2 re-saved in shards), then for a server
of each third of the blocks, a client (embeddings, final norm, head) and `swarm status`, copies only the files that
box needs (`swarmbatch model files`) and reports their bytes against the whole checkpoint's. It also times the model
id on a span-only box (the manifest's digest, plus checking the span's shards) against hashing the whole checkpoint
without a manifest, the baseline, in the same run.

usage: python bench/span_disk.py [--model tiny|smollm2] [--layers 12] [--hidden 256] [--shard-size 2MB]
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from modelprep import prepare_smollm2, write_tiny_model  # noqa: E402
from swarmnet.manifest import DIGEST_CACHE, MANIFEST_FILE, write_manifest  # noqa: E402
from swarmnet.model_spec import ModelSpec  # noqa: E402


def sharded_checkpoint(args: argparse.Namespace, work: Path) -> Path:
    """The checkpoint to cut: a tiny model, or SmolLM2 re-saved in shards of --shard-size."""
    if args.model == "tiny":
        return write_tiny_model(work / "whole", layers=args.layers, hidden_size=args.hidden,
                                shard_size=args.shard_size, manifest=True)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = prepare_smollm2(Path.home() / ".cache/swarmbatch-test/models")
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).save_pretrained(
        work / "whole", max_shard_size=args.shard_size)
    AutoTokenizer.from_pretrained(source).save_pretrained(work / "whole")
    write_manifest(work / "whole")
    return work / "whole"


def box(whole: Path, out: Path, prefixes: list[str]) -> Path:
    """A copy of only what a box loading `prefixes` needs."""
    out.mkdir()
    for name in ModelSpec.open(whole).box_files(prefixes):
        shutil.copy2(whole / name, out / name)
    return out


def weight_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def timed_model_id(directory: Path, prefixes: list[str]) -> float:
    """Seconds to the model id, checking the files for `prefixes`, with no digest cached yet."""
    (directory / DIGEST_CACHE).unlink(missing_ok=True)
    began = time.perf_counter()
    spec = ModelSpec.open(directory)
    _ = spec.model_id
    spec.require(prefixes)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--shard-size", default="2MB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="span-disk-") as tmp:
        work = Path(tmp)
        whole = sharded_checkpoint(args, work)
        spec = ModelSpec.open(whole)
        n, total = spec.num_blocks, weight_bytes(whole)
        thirds = [(i * n // 3, (i + 1) * n // 3) for i in range(3)]
        boxes = [(f"server of blocks {a}:{b}", spec.block_prefixes(a, b)) for a, b in thirds]
        boxes += [("client (embeddings, norm, head)", spec.head_prefixes), ("swarm status", [])]
        print(f"{args.model}: {n} blocks, {len(spec.manifest.files)} shards, {total} bytes of weights")
        print("| box | weight files | bytes | share of the whole checkpoint |\n|---|---|---|---|")
        for i, (label, prefixes) in enumerate(boxes):
            held = box(whole, work / f"box{i}", prefixes)
            print(f"| {label} | {len(list(held.glob('*.safetensors')))} | {weight_bytes(held)} | "
                  f"{weight_bytes(held) / total:.2f} |")
        print(f"| whole checkpoint | {len(spec.manifest.files)} | {total} | 1.00 |")
        baseline = work / "no-manifest"
        shutil.copytree(whole, baseline)
        (baseline / MANIFEST_FILE).unlink()
        hashed = timed_model_id(baseline, [])
        span = timed_model_id(work / "box0", boxes[0][1])
        print(f"model id: span-only box (manifest + its shards checked) {span:.3f} s, whole checkpoint without "
              f"manifest (all hashed) {hashed:.3f} s: ratio {span / hashed:.2f}")


if __name__ == "__main__":
    main()
