"""`swarmbatch demo`: the main job, embedded — a local swarm of two block servers summarizes sample documents."""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from jobs.settings import get_settings
from modelprep import prepare_model
from servers.launcher import LocalSwarm
from swarmclient.textgen import generate_texts

SAMPLES = Path(__file__).resolve().parent.parent / "samples" / "documents"
PROMPT = "Summarize the following text in one sentence.\n\n{text}"


def sample_documents() -> list[Path]:
    """The documents shipped with the repository."""
    return sorted(SAMPLES.glob("*.txt"))


def run_demo(echo: Callable[[str], None], *, max_new_tokens: int = 48) -> None:
    """Prepare SmolLM2, start a DHT and two servers (15 blocks each), summarize, report, stop everything."""
    settings = get_settings()
    began = time.perf_counter()
    echo("Preparing SmolLM2-135M-Instruct (converted once, then cached)...")
    model_dir = prepare_model("smollm2", cache_dir=settings.models_dir)
    echo("Starting a DHT node and two block servers (blocks 0:15 and 15:30) on 127.0.0.1...")
    with LocalSwarm(model_dir, [(0, 15), (15, 30)], log_dir=settings.home / "demo-logs") as swarm:
        echo(f"Swarm ready in {time.perf_counter() - began:.1f} s; DHT at {swarm.initial_peers[0]}")
        docs = sample_documents()
        prompts = [PROMPT.format(text=doc.read_text().strip()) for doc in docs]
        echo(f"Summarizing {len(docs)} documents through the swarm...")
        generation_began = time.perf_counter()
        outputs = generate_texts(model_dir, prompts, initial_peers=swarm.initial_peers, chat=True,
                                 max_new_tokens=max_new_tokens)
        seconds = time.perf_counter() - generation_began
    for doc, output in zip(docs, outputs):
        echo(f"\n{doc.name}:\n  {output['text'].strip()}")
    tokens = sum(len(o["token_ids"]) for o in outputs)
    echo(f"\n{tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tokens/s; "
         f"total wall time {time.perf_counter() - began:.1f} s. All processes stopped.")
