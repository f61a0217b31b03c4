"""How a model turns its final hidden states into one embedding: pooling, truncation (Matryoshka), normalization.

Read from the model directory as sentence-transformers writes it: `modules.json` lists the modules; the Pooling
module's folder (e.g. `1_Pooling/config.json`) names the mode (`pooling_mode_mean_tokens`, `_cls_token`,
`_lasttoken`), and a `sentence_transformers.models.Normalize` module means unit-length vectors. Without
`modules.json` (a plain causal LM) the default is what a decoder model's embedding is taken as by vLLM and the
recent decoder embedders: the last token's state, normalized.

`sentence_bert_config.json` (the Transformer module's settings), when present: its `max_seq_length` is the longest
input the model embeds (sentence-transformers truncates longer ones silently; jobs.line_embeddings refuses them, as
OpenAI refuses an input over its model's limit), and `do_lower_case: true` means inputs are lowercased before they
are tokenized, as sentence-transformers does.

`dimensions` (OpenAI's parameter) truncates the pooled vector to its first d values before it is normalized; it is
allowed only where the model says it was trained for it (Matryoshka): config.json's `matryoshka_dimensions` (the
sizes allowed) or `is_matryoshka: true` (any size up to the hidden size), the keys vLLM reads.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmnet.errors import ModelDirError

if TYPE_CHECKING:  # torch loads where vectors are pooled: the API reads a Pooling without it
    import torch

SENTENCE_BERT_CONFIG = "sentence_bert_config.json"
POOLING_TYPE = "sentence_transformers.models.Pooling"
NORMALIZE_TYPE = "sentence_transformers.models.Normalize"


class PoolingMode(StrEnum):
    """Which token states make the embedding."""

    mean = "mean"            # the mean over the real (unmasked) tokens
    cls = "cls"              # the first real token
    lasttoken = "lasttoken"  # the last real token (decoder models: the only one that saw the whole text)


# 1_Pooling/config.json's flags, by mode (the modes sentence-transformers has that we do not are refused by name)
MODE_FLAGS = {"pooling_mode_mean_tokens": PoolingMode.mean, "pooling_mode_cls_token": PoolingMode.cls,
              "pooling_mode_lasttoken": PoolingMode.lasttoken}
UNSUPPORTED_FLAGS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class Pooling:
    """A model's embedding recipe; `dimensions` is None (no truncation), or the sizes allowed (empty: any)."""

    mode: PoolingMode = PoolingMode.lasttoken
    normalize: bool = True
    matryoshka: tuple[int, ...] | None = None  # None: `dimensions` is refused; (): any size up to the hidden size
    source: str = "default"  # where the recipe came from, for messages and docs
    max_seq_length: int | None = None  # sentence_bert_config.json's: the most tokens of an input (None: the context)
    lower_case: bool = False           # sentence_bert_config.json's do_lower_case: inputs are lowercased first

    def dimensions_problem(self, dimensions: int, hidden_size: int) -> str | None:
        """Why `dimensions` cannot be asked of this model (None when it can)."""
        if self.matryoshka is None:
            return (f"this model was not trained for shorter embeddings (its config declares no Matryoshka "
                    f"dimensions); omit dimensions to get all {hidden_size}")
        allowed = (*(self.matryoshka or range(1, hidden_size + 1)), hidden_size)  # the full size is always allowed
        if dimensions not in allowed or dimensions > hidden_size:
            sizes = ", ".join(map(str, self.matryoshka)) if self.matryoshka else f"1 to {hidden_size}"
            return f"this model's embeddings may be shortened to {sizes} dimensions"
        return None


def read_pooling(model_dir: str | Path, config: object | None = None) -> Pooling:
    """The model's Pooling: its sentence-transformers modules when present, else the default; raises ModelDirError."""
    root = Path(model_dir)
    matryoshka = _matryoshka(config)
    inputs = _input_settings(root / SENTENCE_BERT_CONFIG)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return Pooling(matryoshka=matryoshka, **inputs)
    modules = _json(modules_file)
    if not isinstance(modules, list):
        raise ModelDirError(f"{modules_file} must be a list of modules, as sentence-transformers writes it")
    types = [str(m.get("type")) for m in modules if isinstance(m, dict)]
    pooling = next((m for m in modules if isinstance(m, dict) and m.get("type") == POOLING_TYPE), None)
    if pooling is None:
        return Pooling(normalize=NORMALIZE_TYPE in types, matryoshka=matryoshka, source=str(modules_file), **inputs)
    config_file = root / str(pooling.get("path", "")) / "config.json"
    return Pooling(_mode(config_file), NORMALIZE_TYPE in types, matryoshka, str(config_file), **inputs)


def _input_settings(config_file: Path) -> dict[str, Any]:
    """sentence_bert_config.json's `max_seq_length` and `do_lower_case`, as Pooling's fields (none without it)."""
    if not config_file.is_file():
        return {}
    settings = _json(config_file)
    if not isinstance(settings, dict):
        raise ModelDirError(f"{config_file} must be a JSON object")
    length, lower = settings.get("max_seq_length"), settings.get("do_lower_case", False)
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 1):
        raise ModelDirError(f"{config_file}: max_seq_length must be a positive integer (got {length!r})")
    if not isinstance(lower, bool):
        raise ModelDirError(f"{config_file}: do_lower_case must be true or false (got {lower!r})")
    return {"max_seq_length": length, "lower_case": lower}


def _mode(config_file: Path) -> PoolingMode:
    """The one pooling mode a Pooling module's config turns on."""
    flags = _json(config_file) if config_file.is_file() else {}
    if not isinstance(flags, dict):
        raise ModelDirError(f"{config_file} must be a JSON object")
    unsupported = [name for name in UNSUPPORTED_FLAGS if flags.get(name)]
    modes = [mode for name, mode in MODE_FLAGS.items() if flags.get(name)]
    if unsupported or len(modes) != 1:
        raise ModelDirError(f"{config_file}: pooling must be exactly one of mean, cls or lasttoken "
                            f"(found {', '.join([*unsupported, *modes]) or 'none'}); this service pools no other way")
    return modes[0]


def _matryoshka(config: object | None) -> tuple[int, ...] | None:
    """The Matryoshka sizes config.json declares: `matryoshka_dimensions`, or () for `is_matryoshka: true`."""
    sizes = getattr(config, "matryoshka_dimensions", None)
    if isinstance(sizes, list) and sizes and all(isinstance(s, int) and s > 0 for s in sizes):
        return tuple(sorted(set(sizes)))
    return () if getattr(config, "is_matryoshka", False) is True else None


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{path} is not readable JSON ({e}); fix or remove it") from None


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: PoolingMode) -> torch.Tensor:
    """Final hidden states [B, T, H] (final norm applied) and their mask [B, T] (either padding side) -> the pooled
    [B, H] float32 vectors, before truncation and normalization (`finish`)."""
    import torch

    states, mask = hidden.float(), attention_mask.to(hidden.device).long()
    if mode == PoolingMode.mean:
        weights = mask.unsqueeze(-1).float()
        return (states * weights).sum(1) / weights.sum(1).clamp(min=1.0)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    if mode == PoolingMode.lasttoken:
        index = positions.masked_fill(mask == 0, -1).max(1).values
    else:
        index = positions.masked_fill(mask == 0, mask.shape[1]).min(1).values
    return states[torch.arange(states.shape[0], device=states.device), index]


def finish(vector: torch.Tensor, pooling: Pooling, dimensions: int | None = None) -> torch.Tensor:
    """A pooled vector [..., H] as the model's embedding: its first `dimensions` values (all when None), normalized
    to unit length if the model normalizes."""
    import torch

    if dimensions is not None:
        vector = vector[..., :dimensions]
    return torch.nn.functional.normalize(vector, p=2, dim=-1) if pooling.normalize else vector
