"""Resolve a model name or path to a validated local Hugging Face model dir."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from modelprep.errors import ModelPrepError
from modelprep.smollm2 import prepare_smollm2
from swarmnet import hf_cache
from swarmnet.families import FAMILIES, unsupported_family
from swarmnet.manifest import MANIFEST_FILE, REMAKE, SHARD_INDEX

logger = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2"
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def prepare_model(name_or_path: str, *, cache_dir: Path) -> Path:
    """Return a local model dir: ``"smollm2"`` is converted/cached in ``cache_dir``; a Hugging Face id
    (``org/name[@revision]``) is its snapshot in the hub cache (its small files downloaded where the hub is
    reachable: swarmnet/hf_cache.py); a path is validated."""
    if name_or_path == SMOLLM2_NAME:
        return prepare_smollm2(cache_dir)
    if hf_cache.is_hf_id(name_or_path):
        path = hf_cache.resolve(name_or_path)
        validate_model_dir(path)
        return path
    path = Path(name_or_path).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelPrepError(
            f"{name_or_path!r} is neither {SMOLLM2_NAME!r}, a Hugging Face id in the local cache, nor a local model "
            "directory; pass a path to a Hugging Face model dir (config.json + *.safetensors) or an id like org/name"
        )
    validate_model_dir(path)
    return path.resolve()


def validate_model_dir(path: Path) -> None:
    """Check ``path`` holds a supported decoder-only model: config, safetensors weights and a tokenizer."""
    _check_model_type(path, _read_config(path))
    _check_weights(path)
    _check_tokenizer(path)


def _read_config(path: Path) -> dict[str, Any]:
    """Read and return ``config.json`` from ``path``."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelPrepError(f"cannot read {path / 'config.json'} ({exc}); fix or re-download the model dir") from exc
    if not isinstance(config, dict):
        raise ModelPrepError(f"{path / 'config.json'} is not a JSON object; fix or re-download the model dir")
    return config


def _check_model_type(path: Path, config: dict[str, Any]) -> None:
    """Reject model types this project cannot split into decoder-layer spans."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelPrepError(f"{path}: {unsupported_family(model_type)}")


def _check_weights(path: Path) -> None:
    """Require safetensors weights: one file, or shards listed in ``model.safetensors.index.json``; with a weights
    manifest, any of them may be absent (each process checks those it opens)."""
    if (path / MANIFEST_FILE).is_file():
        return
    if (path / SHARD_INDEX).is_file():
        _check_shards(path)
        return
    if any(path.glob("*.safetensors")):
        return
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise ModelPrepError(
            f"{path} has only PyTorch .bin/.pt weights; convert them to safetensors "
            "(load with from_pretrained and call save_pretrained) and pass the new dir"
        )
    raise ModelPrepError(f"{path} has no *.safetensors weights; pass a Hugging Face model dir with safetensors weights")


def _check_shards(path: Path) -> None:
    """Check every shard named in the safetensors index exists."""
    try:
        weight_map = json.loads((path / SHARD_INDEX).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelPrepError(
            f"cannot read the weight_map in {path / SHARD_INDEX} ({exc}); re-download the model"
        ) from exc
    missing = sorted({name for name in weight_map.values() if not (path / name).is_file()})
    if missing:
        raise ModelPrepError(f"{path} is missing weight shards {', '.join(missing)} and has no {MANIFEST_FILE}; "
                             f"re-download the model, or {REMAKE}")


def _check_tokenizer(path: Path) -> None:
    """Require tokenizer files next to the weights."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelPrepError(
            f"{path} has no tokenizer ({' / '.join(TOKENIZER_FILES)}); "
            "save the tokenizer into the model dir with tokenizer.save_pretrained(dir)"
        )
