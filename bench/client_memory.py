"""Benchmark: a worker process's memory for the client head of a model of Llama-3-8B's shape, before and after.

The head is what a worker (or `generate`) holds: token embeddings, final norm and LM head, for vocab 128256 x hidden
4096 in bfloat16 as Llama-3-8B ships them (random weights written here, no blocks: the client never loads any).
Each variant loads the head in a fresh process and reports its resident memory (RSS) after loading, the peak, and
the time of one logits call for 1 and 16 rows (after every embedding row was looked up once: safetensors maps the
file, so its pages count once they are used):

- before: the ClientHead of git revision BEFORE (float32 copies of everything, plus a transposed LM head);
- after: today's ClientHead on the CPU (embeddings stay bfloat16, the LM head float32: swarmnet/head.py);
- after, head_dtype=bfloat16: everything in the checkpoint's dtype (as on a GPU).

usage: python bench/client_memory.py [--before 615ee56] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VOCAB, HIDDEN = 128256, 4096


def write_model(out: Path) -> Path:
    """config.json (Llama-3-8B's) and one safetensors file holding only embeddings, final norm and LM head."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                tie_word_embeddings=False, dtype="bfloat16").save_pretrained(out)
    generator = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=generator).to(torch.bfloat16),
               "lm_head.weight": (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02).to(torch.bfloat16),
               "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident memory (VmRSS) or its peak (VmHWM, which, unlike ru_maxrss, starts anew at exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:")) / 1024


def measure(model_dir: str, head_module: str, head_dtype: str | None, threads: int) -> dict[str, float]:
    """In this (fresh) process: load the head, then time logits; memory in MiB, times in ms."""
    import importlib

    import torch

    from swarmnet.model_spec import ModelSpec

    torch.set_num_threads(threads)
    ClientHead = importlib.import_module(head_module).ClientHead  # noqa: N806 - a class
    spec = ModelSpec.open(model_dir)
    base = rss_mib()
    began = time.perf_counter()
    head = ClientHead(spec) if head_dtype is None else \
        ClientHead(spec, device="cpu", head_dtype=None if head_dtype == "auto" else getattr(torch, head_dtype))
    result = {"load_s": time.perf_counter() - began, "rss_before_load_mib": base, "rss_after_load_mib": rss_mib()}
    for start in range(0, VOCAB, 8192):  # every embedding row once: safetensors maps the file, pages come in on use
        head.embed(torch.arange(start, min(start + 8192, VOCAB))[None])
    for rows in (1, 16):
        hidden = torch.randn(rows, 1, HIDDEN)
        head.logits(hidden)
        began = time.perf_counter()
        for _ in range(3):
            head.logits(hidden)
        result[f"logits_{rows}_rows_ms"] = (time.perf_counter() - began) / 3 * 1000
    result["rss_after_use_mib"], result["peak_rss_mib"] = rss_mib(), rss_mib("VmHWM")
    return result


def run_variant(model_dir: Path, head_module: str, head_dtype: str | None, threads: int, path: str) -> dict:
    code = ("import json, sys; sys.path[:0] = sys.argv[1].split(':'); from client_memory import measure; "
            "print(json.dumps(measure(*sys.argv[2:4], None if sys.argv[4] == '-' else sys.argv[4], int(sys.argv[5]))))")
    out = subprocess.run([sys.executable, "-c", code, path, str(model_dir), head_module, head_dtype or "-",
                          str(threads)], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="615ee56", help="the git revision of the 'before' ClientHead")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="client-memory-") as tmp:
        model = write_model(Path(tmp) / "llama3-8b-head")
        old = Path(tmp) / "old"
        old.mkdir()
        (old / "old_head.py").write_text(subprocess.run(["git", "-C", str(ROOT), "show", f"{args.before}:swarmnet/head.py"],
                                                        check=True, capture_output=True, text=True).stdout)
        path = ":".join([str(Path(__file__).parent), str(old), str(ROOT)])
        variants = {f"before ({args.before})": ("old_head", None), "after (CPU default)": ("swarmnet.head", "auto"),
                    "after, head_dtype=bfloat16": ("swarmnet.head", "bfloat16")}
        print(f"{'variant':28} {'RSS loaded':>11} {'RSS used':>9} {'peak RSS':>9} {'logits 1 row':>13} {'16 rows':>8}")
        for name, (module, dtype) in variants.items():
            r = run_variant(model, module, dtype, args.threads, path)
            gib = [r[key] / 1024 for key in ("rss_after_load_mib", "rss_after_use_mib", "peak_rss_mib")]
            print(f"{name:28} {gib[0]:>7.2f} GiB {gib[1]:>5.2f} GiB {gib[2]:>5.2f} GiB "
                  f"{r['logits_1_rows_ms']:>10.0f} ms {r['logits_16_rows_ms']:>5.0f} ms", flush=True)


if __name__ == "__main__":
    main()
