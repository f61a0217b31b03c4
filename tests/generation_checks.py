"""What generation tests through real servers share: transformers' reference tokens, and a failover run."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from launch.local_swarm import LocalSwarm
from swarmclient.generation import generate_tokens
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.session import InferenceSession

# a strict JSON schema whose every answer is short (bounded string, enum, integer range): structured-output tests
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "open", "floors", "mood"],
        "properties": {"city": {"type": "string", "maxLength": 12}, "open": {"type": "boolean"},
                       "floors": {"type": "integer", "minimum": 0, "maximum": 99},
                       "mood": {"enum": ["calm", "busy", "closed"]}}}

def reference_tokens(model_dir: Path, batch: Any, max_new_tokens: int) -> torch.Tensor:
    """transformers' greedy generate of the batch: only the new tokens [B, N]."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    return out[:, batch["input_ids"].shape[1]:]


@dataclass
class FailoverRun:
    """A greedy generation during which the first hop's server was killed -9."""

    tokens: torch.Tensor
    failovers: int
    killed: dict[str, float]
    route_after: list[Any]
    stall: float  # seconds the token after the kill took
    normal_step: float  # seconds the token before it took


def greedy_tokens(model: DistributedModelForCausalLM, session: InferenceSession, batch: Any, max_new_tokens: int,
                  on_token: Callable[[int, torch.Tensor], None]) -> torch.Tensor:
    """Greedy-generate `max_new_tokens` in an open session, calling `on_token(index, tokens)` as each comes out."""
    return generate_tokens(model.head, session.step, batch.input_ids, batch.attention_mask,
                           max_new_tokens=max_new_tokens,
                           params=model.sampling_params(batch.input_ids.shape[0], False, 1.0, 1.0, 0),
                           eos_token_ids=model.eos_token_ids, pad_token_id=model.pad_token_id, on_token=on_token)


def generate_killing_first_hop(model: DistributedModelForCausalLM, swarm: LocalSwarm, batch: Any,
                               max_new_tokens: int, kill_at: int = 12) -> FailoverRun:
    """Greedy-generate `max_new_tokens`, killing -9 the first hop's server when token `kill_at` is out."""
    by_peer = {server.peer_id: server for server in swarm.servers}
    rows = batch.input_ids.shape[0]
    session = model.inference_session(batch_size=rows, max_length=batch.input_ids.shape[1] + max_new_tokens)
    stamps: list[float] = []
    killed: dict[str, float] = {}

    def on_token(index: int, _: torch.Tensor) -> None:
        stamps.append(time.perf_counter())
        if len(stamps) == kill_at:
            victim = session.route[0].peer_id
            by_peer[victim].kill()
            killed[victim] = time.perf_counter()

    with session:
        tokens = greedy_tokens(model, session, batch, max_new_tokens, on_token)
        route_after = session.route
    return FailoverRun(tokens, session.failovers, killed, route_after, stall=stamps[kill_at] - stamps[kill_at - 1],
                       normal_step=stamps[kill_at - 1] - stamps[kill_at - 2])
