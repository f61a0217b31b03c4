"""Text in, text out: tokenize prompts (optionally with the chat template), generate, decode."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from swarmclient.config import ClientConfig
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.verification_policy import VerificationTally
from swarmnet.membership import SwarmAccess


def load_tokenizer(model_dir: Path) -> Any:
    """The model's tokenizer, padding on the left (what batched decoding needs)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def render_prompt(tokenizer: Any, prompt: str, *, chat: bool) -> str:
    """The raw prompt, or the chat template applied to one user message."""
    if not chat:
        return prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def generate_texts(model_dir: Path, prompts: list[str], *, initial_peers: list[str], chat: bool = False,
                   max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                   access: SwarmAccess | None = None, verify_fraction: float = 0.0,
                   verification: VerificationTally | None = None, push: bool = True, micro_batches: int = 1,
                   ring: bool = True) -> list[dict[str, Any]]:
    """[{"prompt", "text", "token_ids"}] for each prompt, generated as one batch through the swarm.

    verify_fraction: hop steps checked on a second server (docs/security.md "Checked outputs"), counted into `verification`.
    push: servers push each step's outputs to the next server (ClientConfig.push).
    micro_batches: the batch runs as this many micro-batches at once, pipelined over the servers (ClientConfig).
    ring: a greedy batch asks a last server that holds the head to guess each next step (ClientConfig.ring).
    """
    tokenizer = load_tokenizer(model_dir)
    texts = [render_prompt(tokenizer, p, chat=chat) for p in prompts]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not chat)
    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=initial_peers, access=access,
                                                     config=ClientConfig(verify_fraction=verify_fraction, push=push,
                                                                        micro_batches=micro_batches, ring=ring)) as model:
        params = model.sampling_params(len(prompts), temperature > 0, temperature, top_p, seed)
        new = model.generate_new_tokens(encoded.input_ids, encoded.attention_mask,
                                        max_new_tokens=max_new_tokens, params=params, verification=verification)
        outputs = []
        for prompt, row in zip(prompts, new.tolist(), strict=True):
            ids = strip_after_eos(row, model.eos_token_ids)
            outputs.append({"prompt": prompt, "text": tokenizer.decode(ids, skip_special_tokens=True),
                            "token_ids": ids})
    return outputs


def strip_after_eos(token_ids: list[int], eos_token_ids: set[int]) -> list[int]:
    """Tokens up to and including the first EOS (the padding after it is dropped)."""
    for index, token in enumerate(token_ids):
        if token in eos_token_ids:
            return token_ids[: index + 1]
    return token_ids
