"""Write a tiny embedding model: a tiny random decoder (modelprep.tiny) with the files sentence-transformers keeps
beside it (modules.json, the Pooling module's config, a Normalize module), for tests of `/v1/embeddings`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from modelprep.errors import ModelPrepError
from modelprep.tiny import write_tiny_model

POOLING_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
                 "lasttoken": "pooling_mode_lasttoken"}
ALL_FLAGS = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
             "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")


def write_tiny_embedding_model(out: Path, *, pooling: str = "mean", normalize: bool = True,
                               matryoshka_dimensions: list[int] | None = None, max_seq_length: int | None = None,
                               do_lower_case: bool = False, **tiny: Any) -> Path:
    """A tiny random model (write_tiny_model's options in `tiny`) laid out as a sentence-transformers model with
    `pooling` (mean, cls or lasttoken) and, if `normalize`, a Normalize module; `matryoshka_dimensions` goes into
    config.json (the sizes `dimensions` may ask for); a `max_seq_length` (the longest input embedded) writes
    sentence_bert_config.json with it and `do_lower_case`. Returns the directory."""
    if pooling not in POOLING_FLAGS:
        raise ModelPrepError(f"pooling must be one of {', '.join(POOLING_FLAGS)} (got {pooling!r})")
    out = write_tiny_model(out, **tiny)
    if matryoshka_dimensions:
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": matryoshka_dimensions},
                                                    indent=2))
    hidden = json.loads((out / "config.json").read_text())["hidden_size"]
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    if max_seq_length is not None:
        (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                   "do_lower_case": do_lower_case}, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    flags = {name: name == POOLING_FLAGS[pooling] for name in ALL_FLAGS}
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden, **flags,
                                                               "include_prompt": True}, indent=2))
    return out
