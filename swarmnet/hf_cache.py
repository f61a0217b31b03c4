"""Hugging Face model ids (`org/name`, `org/name@revision`): a snapshot of the local hub cache, and where the hub
is reachable (HF_HUB_OFFLINE=0) downloads of only the files a process opens.

The cache is laid out as huggingface_hub lays it: `$HF_HUB_CACHE/models--org--name/` holds `refs/<branch>` (a
commit hash), `snapshots/<commit>/<file>` (symlinks) and `blobs/<sha256 or git sha1>` (the content). A snapshot
needs only some of the shards when a manifest is beside them (manifest.py). Where the hub is reachable, resolving
an id downloads the small files (config, tokenizer, index) and writes the manifest from the hub's own LFS sha256s
and safetensors headers, without the weights; each shard is then downloaded when a process first opens it (a
server its span's, a client the head's), with the allow-patterns `allow_patterns` computes.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from swarmnet.errors import ModelDirError
from swarmnet.manifest import MANIFEST_FILE, FileDigests, FileEntry, Manifest, write_manifest

SMALL_FILES = ["*.json", "*.txt", "*.model", "*.jinja", "tokenizer*"]  # config, tokenizer, index, generation config
_HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def is_hf_id(name: str) -> bool:
    """Whether `name` reads as a Hugging Face id (`org/name[@revision]`) rather than a local path."""
    return bool(_HF_ID.fullmatch(name)) and not Path(name).expanduser().exists()


def hub_cache() -> Path:
    """The hub cache huggingface_hub uses: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def downloads_allowed() -> bool:
    """Whether the hub may be asked (HF_HUB_OFFLINE=0; the CLI sets it to 1 unless the user set it)."""
    from huggingface_hub.constants import is_offline_mode

    return not is_offline_mode()


def allow_patterns(tensor_files: dict[str, str], prefixes: list[str]) -> list[str]:
    """What a process holding tensors under `prefixes` downloads: the small files and the shards holding them."""
    from swarmnet.manifest import shards_for

    return [*SMALL_FILES, *shards_for(tensor_files, prefixes)]


def resolve(model_id: str, cache: Path | None = None) -> Path:
    """`org/name[@revision]` -> its snapshot dir: from the cache, else (hub reachable) its small files downloaded."""
    repo_id, _, revision = model_id.partition("@")
    cache = cache or hub_cache()
    snapshot = cached_snapshot(cache, repo_id, revision or "main")
    if snapshot is not None:
        return snapshot
    if not downloads_allowed():
        raise ModelDirError(f"{model_id} is neither a local directory nor in the Hugging Face cache {cache} (no snapshot "
                            "with a config.json); "
                            "set HF_HUB_OFFLINE=0 where the hub is reachable, or copy the cache there (HF_HUB_CACHE)")
    return _download_small_files(repo_id, revision or None, cache)


def cached_snapshot(cache: Path, repo_id: str, revision: str) -> Path | None:
    """The cached snapshot of `repo_id` at `revision` (a commit, or a branch/tag its refs/ file resolves)."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    commit = revision
    if not _COMMIT.fullmatch(revision):
        try:
            commit = (storage / "refs" / revision).read_text().strip()
        except OSError:
            return None
    snapshot = storage / "snapshots" / commit
    return snapshot if (snapshot / "config.json").is_file() else None


def snapshot_origin(path: Path) -> tuple[str, str, Path] | None:
    """(repo id, commit, cache dir) of a snapshot dir of the hub cache, or None for any other directory."""
    storage = path.parent.parent
    if path.parent.name != "snapshots" or not storage.name.startswith("models--"):
        return None
    return storage.name.removeprefix("models--").replace("--", "/"), path.name, storage.parent


def fetch(snapshot: Path, tensor_files: dict[str, str], prefixes: list[str]) -> bool:
    """Download the shards a process needs into `snapshot` where that is possible; returns whether it tried."""
    origin = snapshot_origin(snapshot)
    if origin is None or not downloads_allowed():
        return False
    from huggingface_hub import snapshot_download

    repo_id, commit, cache = origin
    try:
        snapshot_download(repo_id, revision=commit, cache_dir=cache, endpoint=_endpoint(),
                          allow_patterns=allow_patterns(tensor_files, prefixes))
    except OSError as e:  # huggingface_hub's HTTP, connection and missing-entry errors are all OSErrors
        raise ModelDirError(f"cannot download the files of {', '.join(p + '*' for p in prefixes)} of {repo_id}@{commit} "
                            f"from the Hugging Face hub ({type(e).__name__}: {_first_line(e)}); check the network and "
                            "HF_TOKEN, or copy the files into the snapshot") from e
    return True


def _endpoint() -> str | None:
    """$HF_ENDPOINT read now (huggingface_hub reads it once, at import): a mirror, or None for the hub."""
    return os.environ.get("HF_ENDPOINT") or None


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else "no detail"


def _download_small_files(repo_id: str, revision: str | None, cache: Path) -> Path:
    """Download config, tokenizer and index (no weights), then write the manifest from the hub's metadata."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, endpoint=_endpoint(),
                                          allow_patterns=SMALL_FILES))
        if not (snapshot / MANIFEST_FILE).is_file():
            write_manifest(snapshot, hub_manifest(repo_id, snapshot.name, snapshot))
    except (HfHubHTTPError, OSError) as e:
        raise ModelDirError(f"cannot download {repo_id} from the Hugging Face hub ({type(e).__name__}: "
                            f"{_first_line(e)}); check the id, HF_TOKEN and the network") from e
    return snapshot


def hub_manifest(repo_id: str, commit: str, snapshot: Path) -> Manifest:
    """The manifest of a hub repo at `commit` from its LFS sha256s and safetensors headers (no weights read)."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=_endpoint())
    info = api.model_info(repo_id, revision=commit, files_metadata=True)
    lfs = {s.rfilename: s.lfs for s in info.siblings or [] if s.rfilename.endswith(".safetensors") and s.lfs}
    weight_map = api.get_safetensors_metadata(repo_id, revision=commit).weight_map
    files = {name: FileEntry(entry.sha256, entry.size,
                             tuple(sorted(t for t, f in weight_map.items() if f == name)))
             for name, entry in lfs.items() if name in set(weight_map.values())}
    return Manifest(FileDigests(snapshot).sha256(snapshot / "config.json"), files)
