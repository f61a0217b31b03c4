"""Which token ids end a generation: EOS as transformers reads it from a model directory.

transformers' `generate` stops at `generation_config.json`'s eos_token_id (an int or a list), which defaults to
`config.json`'s; chat checkpoints list more there than in config.json (Llama-3-Instruct adds `<|eot_id|>`). We take
the union of both and of the tokenizer's eos token, so no source's EOS is missed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def eos_token_ids(path: Path) -> set[int]:
    """The union of config.json's and generation_config.json's eos_token_id and the tokenizer's eos token id."""
    ids = _ids(_read(path / "config.json").get("eos_token_id"))
    ids |= _ids(_read(path / "generation_config.json").get("eos_token_id"))
    token = _read(path / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):  # older tokenizer configs: {"content": "</s>", ...}
        token = token.get("content")
    if isinstance(token, str):
        ids |= _token_ids(path / "tokenizer.json", token)
    return ids


def _ids(value: Any) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _token_ids(tokenizer_file: Path, token: str) -> set[int]:
    """The id of `token` in a fast tokenizer's tokenizer.json (its added tokens, then its vocabulary)."""
    tokenizer = _read(tokenizer_file)
    for added in tokenizer.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == token:
            return _ids(added.get("id"))
    vocab = (tokenizer.get("model") or {}).get("vocab")
    return _ids(vocab.get(token)) if isinstance(vocab, dict) else set()


def _read(file: Path) -> dict[str, Any]:
    """A JSON object from `file`, or {} when it is missing or not one."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
