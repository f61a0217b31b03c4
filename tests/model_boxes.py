"""What a box holds, built for tests: a copy of a model dir with only some of its files, and a Hugging Face hub
cache laid out as huggingface_hub lays it (refs/, snapshots/<commit>/ symlinks, blobs/ named by content hash)."""
from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from swarmnet.model_spec import ModelSpec

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def box_copy(model_dir: Path, out: Path, *, blocks: tuple[int, int] | None = None, head: bool = False) -> Path:
    """Copy into `out` only what a server of `blocks` and/or a client (`head`) needs (`swarmbatch model files`)."""
    spec = ModelSpec.open(model_dir)
    prefixes = (spec.block_prefixes(*blocks) if blocks else []) + (spec.head_prefixes if head else [])
    out.mkdir(parents=True)
    for name in spec.box_files(prefixes):
        shutil.copy2(model_dir / name, out / name)
    return out


def weight_bytes(directory: Path) -> int:
    """Bytes of the safetensors files in `directory`."""
    return sum(path.stat().st_size for path in directory.glob("*.safetensors"))


def blob_name(path: Path) -> str:
    """The blob name huggingface_hub gives a file: the sha256 of an LFS file (weights), else its git blob sha1."""
    data = path.read_bytes()
    if path.suffix == ".safetensors":
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hf_cache(model_dir: Path, cache: Path, repo_id: str, names: Iterable[str], *, commit: str = COMMIT) -> Path:
    """Lay out `names` of `model_dir` in the hub cache `cache` as `repo_id` at `commit` (refs/main pointing there);
    returns the snapshot dir."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    for name in names:
        blob = storage / "blobs" / blob_name(model_dir / name)
        shutil.copy2(model_dir / name, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    return snapshot
