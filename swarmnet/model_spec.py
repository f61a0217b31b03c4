"""A local Hugging Face model directory: its config, architecture family, weights manifest and revision.

Both the client (embeddings, LM head) and block servers (decoder layers) read model directories
through this module, so both agree on the model id that names the weights on the DHT. The id is the manifest's
digest (manifest.py): a box may hold only the weight files it opens, each checked against the manifest.
"""
from __future__ import annotations

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

from swarmnet import hf_cache
from swarmnet.errors import ModelDirError
from swarmnet.families import FAMILIES, Family, unsupported_family
from swarmnet.manifest import MANIFEST_FILE, REMAKE, FileDigests, Manifest, make_manifest, read_manifest
from swarmnet.special_tokens import eos_token_ids

__all__ = ["FAMILIES", "ModelSpec", "unsupported_family"]


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
        if not (spec.path / MANIFEST_FILE).is_file() and not any(spec.path.glob("*.safetensors")):
            raise ModelDirError(f"{spec.path} has no *.safetensors weights (and no {MANIFEST_FILE}); convert the "
                                "model to safetensors")
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
    def manifest(self) -> Manifest:
        """The weights manifest: the file beside the config (its config digest checked), else made from the whole
        checkpoint here (manifest.py)."""
        manifest = read_manifest(self.path)
        if manifest is None:
            return make_manifest(self.path, self._digests)
        config = self._digests.sha256(self.path / "config.json")
        if config != manifest.config_sha256:
            raise ModelDirError(f"{self.path / 'config.json'} has sha256 {config[:16]}…, not the "
                                f"{manifest.config_sha256[:16]}… of {MANIFEST_FILE}; restore it, or {REMAKE}")
        return manifest

    @property
    def tensor_index(self) -> dict[str, Path]:
        """Tensor name -> the file holding it (from the manifest: the file may be absent from this box)."""
        return {name: self.path / file for name, file in self.manifest.tensor_files.items()}

    def files_for(self, prefixes: list[str]) -> list[str]:
        """The weight files holding any tensor under `prefixes` (what a process must have to load them)."""
        return self.manifest.files_for(prefixes)

    def block_prefixes(self, start: int, end: int) -> list[str]:
        """The tensor-name prefixes of blocks [start, end): what a server of that span loads."""
        return [self.family.layer_prefix_of(index) for index in range(start, end)]

    @property
    def head_prefixes(self) -> list[str]:
        """The tensor-name prefixes a client loads: embeddings, final norm, LM head."""
        return [self.family.embed_prefix, self.family.norm_prefix, "lm_head."]

    def box_files(self, prefixes: list[str]) -> list[str]:
        """Every file a box loading `prefixes` needs: the small files here (config, tokenizer, index, manifest;
        no caches) and the weight files holding those tensors."""
        small = [p.name for p in self.path.iterdir()
                 if p.is_file() and p.suffix != ".safetensors" and not p.name.startswith(".")]
        return sorted(small) + self.files_for(prefixes)

    def can_load(self, prefixes: list[str]) -> bool:
        """Whether the files of `prefixes` are here, or can be downloaded (a hub snapshot, the hub reachable)."""
        here = all((self.path / name).is_file() for name in self.files_for(prefixes))
        return here or (hf_cache.snapshot_origin(self.path) is not None and hf_cache.downloads_allowed())

    def require(self, prefixes: list[str]) -> None:
        """Make sure the files holding the tensors under `prefixes` are here and are the manifest's: a missing one
        is downloaded where this is a hub snapshot and the hub is reachable; else, or if altered, ModelDirError."""
        names = [n for n in self.files_for(prefixes) if n not in self._checked]
        if any(not (self.path / name).is_file() for name in names):
            hf_cache.fetch(self.path, self.manifest.tensor_files, prefixes)
        for name in names:
            self._check(name, prefixes)

    def load_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor whose name starts with `prefix`, keyed by the rest of its name; nothing else is read."""
        self.require([prefix])
        wanted: dict[Path, list[str]] = {}
        for name, file in self.tensor_index.items():
            if name.startswith(prefix):
                wanted.setdefault(file, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, names in wanted.items():
            with safe_open(file, framework="pt") as f:
                out.update({n[len(prefix):]: f.get_tensor(n) for n in names})
        return out

    @property
    def revision(self) -> str:
        """The manifest's digest: config and every weight file, whether or not this box holds them."""
        return self.manifest.digest

    @property
    def model_id(self) -> str:
        """The name servers announce under: family and weights revision, so different weights never mix."""
        return f"{self.config.model_type}-{self.num_blocks}L-{self.revision[:16]}"

    @cached_property
    def _digests(self) -> FileDigests:
        return FileDigests(self.path)

    @cached_property
    def _checked(self) -> set[str]:
        """Weight files found equal to the manifest in this process."""
        return set()

    def _check(self, name: str, prefixes: list[str]) -> None:
        path, expected = self.path / name, self.manifest.files[name].sha256
        if not path.is_file():
            raise ModelDirError(f"{self.path} lacks {name}, which holds {', '.join(p + '*' for p in prefixes)}; copy "
                                "it from where the whole checkpoint is (the manifest lists what each file holds)")
        got = self._digests.sha256(path)
        if got != expected:
            raise ModelDirError(f"{path} has sha256 {got}, not the {expected} of {MANIFEST_FILE}: it was altered or "
                                "belongs to other weights; copy it again from where the whole checkpoint is")
        self._checked.add(name)
