"""The weights manifest: which tensors each safetensors file holds and its sha256, plus config.json's sha256.

Its digest is the model's revision (the model id's hash), so a box needs only the files it opens: a server the
shards of its blocks, a client the embeddings, final norm and head, `swarm status` none. The manifest is made once
where the whole checkpoint is (`swarmbatch model manifest DIR`, or `model tiny` / `model prepare`) and copied with
the config; each file a process opens is hashed and checked against it. A directory without a manifest file gets
the same manifest computed in memory from all its files, so its model id equals that of a box holding the file.

`swarmbatch-manifest.json`::

    {"format": 1, "config_sha256": "…",
     "files": {"model-00001-of-00002.safetensors": {"sha256": "…", "size": 123, "tensors": ["model.embed_tokens.weight", …]}}}

The digest is the sha256 of that object as canonical JSON (sorted keys, no spaces): whitespace does not matter.
File hashes are cached in `.swarmbatch-digests.json` beside the files, keyed by size and mtime, so a restart does not
read the weights again; a file in a Hugging Face cache is a symlink to a blob named by its sha256 (`hf_cache.py`),
and that name stands for the file's digest until the file is opened.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

from swarmnet.errors import ModelDirError

MANIFEST_FILE = "swarmbatch-manifest.json"
DIGEST_CACHE = ".swarmbatch-digests.json"
SHARD_INDEX = "model.safetensors.index.json"
FORMAT = 1
REMAKE = "run 'swarmbatch model manifest DIR' where the whole checkpoint is and copy the manifest to every box"
_HASH_CHUNK = 8 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class FileEntry:
    """One safetensors file of the checkpoint."""

    sha256: str
    size: int
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    """Per-file digests and tensor names of a whole checkpoint, and the digest that names it."""

    config_sha256: str
    files: dict[str, FileEntry] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        """sha256 of the canonical JSON: the model's revision."""
        canonical = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def tensor_files(self) -> dict[str, str]:
        """Tensor name -> the file holding it."""
        return {tensor: name for name, entry in self.files.items() for tensor in entry.tensors}

    def files_for(self, prefixes: list[str]) -> list[str]:
        """The files holding any tensor whose name starts with one of `prefixes`, sorted."""
        return shards_for(self.tensor_files, prefixes)

    def to_json(self) -> dict[str, Any]:
        """The manifest file's object."""
        return {"format": FORMAT, "config_sha256": self.config_sha256,
                "files": {name: {"sha256": e.sha256, "size": e.size, "tensors": list(e.tensors)}
                          for name, e in sorted(self.files.items())}}

    @classmethod
    def from_json(cls, data: Any, where: Path) -> Manifest:
        """Parse a manifest file's object; a malformed one raises ModelDirError naming the file."""
        try:
            if data["format"] != FORMAT:
                raise ValueError(f"format {data['format']!r}, expected {FORMAT}")
            files = {str(name): FileEntry(str(e["sha256"]), int(e["size"]), tuple(str(t) for t in e["tensors"]))
                     for name, e in data["files"].items()}
            return cls(str(data["config_sha256"]), files)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ModelDirError(f"{where} is not a swarmbatch manifest ({type(e).__name__}: {e}); {REMAKE}") from e


def shards_for(tensor_files: dict[str, str], prefixes: list[str]) -> list[str]:
    """Which files of a weight map (tensor -> file, as in model.safetensors.index.json) hold tensors under any of
    `prefixes`; pure, so a download can ask for exactly these."""
    wanted = tuple(prefixes)
    return sorted({file for tensor, file in tensor_files.items() if tensor.startswith(wanted)})


def read_manifest(model_dir: Path) -> Manifest | None:
    """The manifest file of `model_dir`, or None where there is none."""
    path = model_dir / MANIFEST_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ModelDirError(f"cannot read {path} ({e}); fix its permissions or {REMAKE}") from e
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ModelDirError(f"{path} is not JSON ({e}); {REMAKE}") from e
    return Manifest.from_json(data, path)


def weight_file_names(model_dir: Path) -> list[str]:
    """The checkpoint's safetensors files: those its index names (present or not), else the ones present."""
    index = model_dir / SHARD_INDEX
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelDirError(f"cannot read the weight_map of {index} ({e}); re-download the model") from e
    return sorted(path.name for path in model_dir.glob("*.safetensors"))


def make_manifest(model_dir: Path, digests: FileDigests) -> Manifest:
    """The manifest of a directory holding the whole checkpoint (raises ModelDirError naming what is missing)."""
    names = weight_file_names(model_dir)
    missing = [name for name in names if not (model_dir / name).is_file()]
    if not names or missing:
        what = f"lacks {', '.join(missing)}" if missing else "has no *.safetensors weights"
        raise ModelDirError(f"{model_dir} {what} and no {MANIFEST_FILE} says what they hold; {REMAKE}")
    files = {}
    for name in names:
        path = model_dir / name
        with safe_open(path, framework="pt") as f:
            tensors = tuple(sorted(f.keys()))
        files[name] = FileEntry(blob_sha256(path) or digests.sha256(path), path.stat().st_size, tensors)
    return Manifest(digests.sha256(model_dir / "config.json"), files)


def write_manifest(model_dir: Path, manifest: Manifest | None = None) -> Path:
    """Write the manifest of the whole checkpoint in `model_dir` (atomically); returns its path."""
    manifest = manifest or make_manifest(model_dir, FileDigests(model_dir))
    path = model_dir / MANIFEST_FILE
    tmp = model_dir / f"{MANIFEST_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest.to_json(), indent=1, sort_keys=True) + "\n")
    tmp.chmod(0o644)
    tmp.replace(path)
    return path


def blob_sha256(path: Path) -> str | None:
    """The sha256 a Hugging Face cache names a file's blob by (`blobs/<sha256>`), or None for any other file."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    return target.name if target.parent.name == "blobs" and _SHA256.fullmatch(target.name) else None


class FileDigests:
    """sha256 of files in one directory, cached in `.swarmbatch-digests.json` by (size, mtime); a read-only
    directory just hashes again next time."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._cache: dict[str, Any] | None = None

    def sha256(self, path: Path) -> str:
        """The file's sha256 (from the cache while its size and mtime are unchanged)."""
        stat = path.stat()
        stamp = [stat.st_size, stat.st_mtime_ns]
        cached = self._load().get(path.name)
        if isinstance(cached, dict) and cached.get("stamp") == stamp:
            return str(cached["sha256"])
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
        self._load()[path.name] = {"stamp": stamp, "sha256": digest.hexdigest()}
        self._save()
        return digest.hexdigest()

    def _load(self) -> dict[str, Any]:
        if self._cache is None:
            try:
                data = json.loads((self.directory / DIGEST_CACHE).read_text())
                self._cache = data if isinstance(data, dict) else {}
            except (OSError, ValueError):
                self._cache = {}
        return self._cache

    def _save(self) -> None:
        tmp = self.directory / f"{DIGEST_CACHE}.{os.getpid()}.tmp"
        try:
            tmp.write_text(json.dumps(self._cache))
            tmp.replace(self.directory / DIGEST_CACHE)
        except OSError:  # a read-only model dir (as compose mounts it): hash again in the next process
            with contextlib.suppress(OSError):  # nothing was written there (EROFS), or it is gone
                tmp.unlink(missing_ok=True)
