"""A local Hugging Face model directory: its config, architecture family, weight files and revision.

Both the client (embeddings, LM head) and block servers (decoder layers) read model directories
through this module, so both agree on the model id that names the weights on the DHT.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors import safe_open

from swarmnet.errors import ModelDirError
from swarmnet.families import FAMILIES, Family, unsupported_family
from swarmnet.special_tokens import eos_token_ids

__all__ = ["FAMILIES", "ModelSpec", "unsupported_family"]
REVISION_FILE = ".swarmbatch-revision.json"
_HASH_CHUNK = 8 << 20


@dataclass(frozen=True)
class ModelSpec:
    """What a process needs to know about one model directory."""

    path: Path

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> ModelSpec:
        """Validate a model directory and return its spec; raises ModelDirError with what to do."""
        spec = cls(Path(path).expanduser().resolve())
        if not (spec.path / "config.json").is_file():
            raise ModelDirError(f"{spec.path} is not a model directory (no config.json); "
                                "run 'swarmbatch model prepare smollm2' or pass a Hugging Face model dir")
        if not spec.weight_files:
            raise ModelDirError(f"{spec.path} has no *.safetensors weights; convert the model to safetensors")
        model_type = json.loads((spec.path / "config.json").read_text()).get("model_type")
        if model_type not in FAMILIES:
            raise ModelDirError(f"{spec.path}: {unsupported_family(model_type)}")
        if refusal := spec.family.refusal(spec.config):
            raise ModelDirError(f"{spec.path}: {refusal}")
        return spec

    @cached_property
    def config(self) -> Any:
        """The transformers config, with the attention implementation every module here uses."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.path)
        # AutoConfig leaves this unset; the mask factory and attention dispatch both key on it.
        family = FAMILIES[config.model_type]
        config._attn_implementation = family.attn_implementation
        if family.experts_implementation:
            config._experts_implementation = family.experts_implementation
        return config

    @property
    def family(self) -> Family:
        """This model's family: what differs between families (swarmnet/families.py)."""
        return FAMILIES[self.config.model_type]

    @property
    def num_blocks(self) -> int:
        """Number of transformer blocks (decoder layers)."""
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        """Width of the hidden states that travel between servers."""
        return int(self.config.hidden_size)

    @property
    def max_length(self) -> int:
        """Longest sequence (prompt + generated) the model supports."""
        return int(self.config.max_position_embeddings)

    @cached_property
    def eos_token_ids(self) -> set[int]:
        """Every token id that ends a generation (config, generation config and tokenizer; special_tokens.py)."""
        return eos_token_ids(self.path)

    @cached_property
    def modeling(self) -> ModuleType:
        """transformers' modeling module of this family (decoder layer, rotary embedding, norm classes)."""
        module = self.family.module
        return importlib.import_module(f"transformers.models.{module}.modeling_{module}")

    def family_class(self, suffix: str) -> Any:
        """A class of this family by suffix, e.g. 'DecoderLayer' -> LlamaDecoderLayer."""
        return getattr(self.modeling, self.family.prefix + suffix)

    def layer_type(self, index: int) -> str:
        """Attention kind of block `index`: 'full_attention' or 'sliding_attention'."""
        types = getattr(self.config, "layer_types", None)
        if types:
            return str(types[index])
        if self.family.window_on_every_layer and getattr(self.config, "sliding_window", None):
            return "sliding_attention"
        return "full_attention"

    @cached_property
    def weight_files(self) -> list[Path]:
        """The safetensors files, sorted."""
        return sorted(self.path.glob("*.safetensors"))

    @cached_property
    def tensor_index(self) -> dict[str, Path]:
        """Tensor name -> file holding it (reads only the safetensors headers)."""
        index: dict[str, Path] = {}
        for file in self.weight_files:
            with safe_open(file, framework="pt") as f:
                index.update({name: file for name in f.keys()})
        return index

    def load_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor whose name starts with `prefix`, keyed by the rest of its name; nothing else is read."""
        wanted: dict[Path, list[str]] = {}
        for name, file in self.tensor_index.items():
            if name.startswith(prefix):
                wanted.setdefault(file, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, names in wanted.items():
            with safe_open(file, framework="pt") as f:
                out.update({n[len(prefix):]: f.get_tensor(n) for n in names})
        return out

    @cached_property
    def revision(self) -> str:
        """sha256 of config.json and the weight files; cached beside them, keyed by size and mtime."""
        stamp = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in self._revision_inputs()]
        cached = self._read_cached_revision(stamp)
        if cached:
            return cached
        digest = hashlib.sha256()
        for file in self._revision_inputs():
            digest.update(file.name.encode())
            with open(file, "rb") as f:
                while chunk := f.read(_HASH_CHUNK):
                    digest.update(chunk)
        revision = digest.hexdigest()
        self._write_cached_revision(stamp, revision)
        return revision

    @property
    def model_id(self) -> str:
        """The name servers announce under: family and weights revision, so different weights never mix."""
        return f"{self.config.model_type}-{self.num_blocks}L-{self.revision[:16]}"

    def _revision_inputs(self) -> list[Path]:
        return [self.path / "config.json", *self.weight_files]

    def _read_cached_revision(self, stamp: list[list[Any]]) -> str | None:
        try:
            data = json.loads((self.path / REVISION_FILE).read_text())
        except (OSError, ValueError):
            return None
        return data.get("revision") if data.get("stamp") == stamp else None

    def _write_cached_revision(self, stamp: list[list[Any]], revision: str) -> None:
        tmp = self.path / f"{REVISION_FILE}.{os.getpid()}.tmp"
        try:
            tmp.write_text(json.dumps({"stamp": stamp, "revision": revision}))
            tmp.replace(self.path / REVISION_FILE)
        except OSError:  # a read-only model dir: hash again next time
            with contextlib.suppress(OSError):  # nothing was written there (EROFS), or it is gone
                tmp.unlink(missing_ok=True)
