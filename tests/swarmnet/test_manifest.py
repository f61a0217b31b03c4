"""Only your span on disk: the weights manifest binds the model id to every file, while a box holds only the files
it opens (a server its span's shards, a client the head's), each checked; Hugging Face ids from a hub cache."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from fake_hub import fake_hub
from model_boxes import COMMIT, box_copy, hf_cache

from modelprep import ModelPrepError, prepare_model, write_tiny_model
from servers.block_loading import load_span
from swarmnet.errors import ModelDirError
from swarmnet.head import ClientHead
from swarmnet.hf_cache import SMALL_FILES, allow_patterns, snapshot_origin
from swarmnet.manifest import MANIFEST_FILE
from swarmnet.model_spec import ModelSpec

REPO = "acme/tiny-sharded"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 6-layer Llama cut into 21 shards of at most 60 KB, with its manifest."""
    return write_tiny_model(tmp_path_factory.mktemp("sharded") / "m", layers=6, seed=4, shard_size="60KB",
                            manifest=True)


def span_output(spec: ModelSpec, start: int, end: int) -> torch.Tensor:
    hidden = torch.randn(2, 5, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    return load_span(spec, start, end)(hidden, torch.ones(2, 5, dtype=torch.long), torch.arange(5).expand(2, 5))


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_server_box_with_only_its_shards_has_the_whole_models_id_and_computes_the_same(sharded: Path,
                                                                                        tmp_path: Path) -> None:
    whole = ModelSpec.open(sharded)
    box = box_copy(sharded, tmp_path / "box", blocks=(2, 4))
    assert len(list(box.glob("*.safetensors"))) < len(list(sharded.glob("*.safetensors"))) / 2
    spec = ModelSpec.open(box)
    assert spec.model_id == whole.model_id
    assert torch.equal(span_output(spec, 2, 4), span_output(whole, 2, 4))


def test_a_box_says_which_spans_it_can_load(sharded: Path, tmp_path: Path) -> None:
    spec = ModelSpec.open(box_copy(sharded, tmp_path / "box", blocks=(2, 4)))
    assert spec.can_load(spec.block_prefixes(2, 4)) and spec.can_load(spec.block_prefixes(3, 4))
    assert not spec.can_load(spec.block_prefixes(0, 2)) and not spec.can_load(spec.block_prefixes(2, 5))


def test_a_whole_checkpoint_without_its_manifest_file_has_the_same_model_id(sharded: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(sharded, tmp_path / "copy"))
    (copy / MANIFEST_FILE).unlink()
    assert ModelSpec.open(copy).model_id == ModelSpec.open(sharded).model_id


def test_a_client_box_with_only_the_head_files_computes_the_same_logits(sharded: Path, tmp_path: Path) -> None:
    box = box_copy(sharded, tmp_path / "client", head=True)
    assert len(list(box.glob("*.safetensors"))) == 3  # embeddings, final norm and head: 3 of 21 shards here
    hidden = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[1, 5, 9]])
    here, there = ClientHead(ModelSpec.open(box), device="cpu"), ClientHead(ModelSpec.open(sharded), device="cpu")
    assert torch.equal(here.embed(ids), there.embed(ids)) and torch.equal(here.logits(hidden), there.logits(hidden))


def test_a_shard_altered_by_one_byte_is_refused_with_one_line_naming_it_and_its_digest(sharded: Path,
                                                                                     tmp_path: Path) -> None:
    box = box_copy(sharded, tmp_path / "box", blocks=(0, 2))
    spec = ModelSpec.open(box)
    altered = box / spec.files_for(spec.block_prefixes(1, 2))[-1]
    expected = spec.manifest.files[altered.name].sha256
    flip_last_byte(altered)
    with pytest.raises(ModelDirError) as err:
        load_span(ModelSpec.open(box), 0, 2)
    assert len(str(err.value).splitlines()) == 1
    assert f"{altered} has sha256 " in str(err.value) and f"not the {expected} of {MANIFEST_FILE}" in str(err.value)


def test_other_weights_get_another_model_id_and_their_shard_is_refused(sharded: Path, tmp_path: Path) -> None:
    other = write_tiny_model(tmp_path / "other", layers=6, seed=5, shard_size="60KB", manifest=True)
    assert ModelSpec.open(other).model_id != ModelSpec.open(sharded).model_id
    box = box_copy(sharded, tmp_path / "box", blocks=(0, 1))
    swapped = ModelSpec.open(box).files_for(["model.layers.0."])[0]
    shutil.copy(other / swapped, box / swapped)  # same name and size, other weights
    with pytest.raises(ModelDirError, match=f"{swapped} has sha256 .* belongs to other weights"):
        load_span(ModelSpec.open(box), 0, 1)


def test_a_box_missing_a_shard_it_needs_says_which_file_in_one_line(sharded: Path, tmp_path: Path) -> None:
    box = box_copy(sharded, tmp_path / "box", blocks=(0, 2))
    with pytest.raises(ModelDirError) as err:
        load_span(ModelSpec.open(box), 0, 3)
    needed = sorted(set(ModelSpec.open(box).files_for(["model.layers.2."])) - {p.name for p in box.iterdir()})
    assert str(err.value).startswith(f"{box} lacks {needed[0]}, which holds") and "\n" not in str(err.value)


def test_some_shards_without_a_manifest_are_refused_rather_than_named_as_other_weights(sharded: Path,
                                                                                     tmp_path: Path) -> None:
    box = box_copy(sharded, tmp_path / "box", blocks=(0, 2))
    (box / MANIFEST_FILE).unlink()
    with pytest.raises(ModelDirError, match=rf"lacks .* and no {MANIFEST_FILE} says what they hold; run "
                                            "'swarmbatch model manifest DIR'"):
        _ = ModelSpec.open(box).model_id
    with pytest.raises(ModelPrepError, match=f"missing weight shards .* and has no {MANIFEST_FILE}"):
        prepare_model(str(box), cache_dir=tmp_path)


def test_a_config_edited_after_the_manifest_is_refused(sharded: Path, tmp_path: Path) -> None:
    box = box_copy(sharded, tmp_path / "box", blocks=(0, 1))
    config = json.loads((box / "config.json").read_text())
    (box / "config.json").write_text(json.dumps({**config, "rope_theta": 1.0}))
    with pytest.raises(ModelDirError, match=f"config.json has sha256 .*, not the .* of {MANIFEST_FILE}"):
        _ = ModelSpec.open(box).model_id


def test_a_span_downloads_only_the_small_files_and_the_shards_its_index_names_for_its_blocks(sharded: Path) -> None:
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    spec = ModelSpec.open(sharded)
    patterns = allow_patterns(weight_map, spec.block_prefixes(2, 4))
    shards = patterns[len(SMALL_FILES):]
    assert patterns[:len(SMALL_FILES)] == SMALL_FILES
    assert shards == sorted({f for t, f in weight_map.items() if t.startswith(("model.layers.2.", "model.layers.3."))})
    assert 0 < len(shards) < len(set(weight_map.values())) / 2
    assert not any(weight_map[t] in shards for t in weight_map if t.startswith("model.layers.5."))
    head = allow_patterns(weight_map, spec.head_prefixes)[len(SMALL_FILES):]
    assert {weight_map["model.embed_tokens.weight"], weight_map["lm_head.weight"]} <= set(head)


# ---- Hugging Face ids, offline from a hub cache laid out as huggingface_hub lays it --------------------------------
def test_a_hub_id_resolves_offline_to_its_cached_snapshot_with_the_model_id_of_the_same_files(
        sharded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = [p.name for p in sharded.iterdir() if p.is_file() and p.name != MANIFEST_FILE and p.name[0] != "."]
    snapshot = hf_cache(sharded, tmp_path / "hub", REPO, names)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    resolved = prepare_model(REPO, cache_dir=tmp_path / "models")
    assert resolved == snapshot and snapshot_origin(resolved) == (REPO, COMMIT, tmp_path / "hub")
    assert prepare_model(f"{REPO}@{COMMIT}", cache_dir=tmp_path / "models") == snapshot
    spec = ModelSpec.open(resolved)
    assert spec.model_id == ModelSpec.open(sharded).model_id  # blob names stand for the shards' digests
    assert torch.equal(span_output(spec, 0, 6), span_output(ModelSpec.open(sharded), 0, 6))


def test_a_hub_snapshot_with_only_a_spans_shards_and_the_manifest_serves_it_and_refuses_an_altered_blob(
        sharded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ModelSpec.open(sharded)
    snapshot = hf_cache(sharded, tmp_path / "hub", REPO, spec.box_files(spec.block_prefixes(4, 6)))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cached = ModelSpec.open(prepare_model(REPO, cache_dir=tmp_path / "models"))
    assert cached.model_id == spec.model_id
    assert torch.equal(span_output(cached, 4, 6), span_output(spec, 4, 6))
    blob = (snapshot / cached.files_for(["model.layers.5."])[-1]).resolve()
    flip_last_byte(blob)
    with pytest.raises(ModelDirError, match="has sha256 .* not the .* of swarmbatch-manifest.json") as err:
        load_span(ModelSpec.open(snapshot), 4, 6)
    assert len(str(err.value).splitlines()) == 1


def test_a_hub_id_not_in_the_cache_offline_is_one_line_saying_what_to_do(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ModelDirError, match=r"acme/absent is neither a local directory nor in the Hugging Face cache "
                                            r".*; set HF_HUB_OFFLINE=0 where the hub is reachable") as err:
        prepare_model("acme/absent", cache_dir=tmp_path / "models")
    assert "\n" not in str(err.value)



def test_a_hub_snapshot_downloads_only_the_shards_a_server_loads_where_the_hub_is_reachable(
        sharded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a snapshot with the small files and the manifest only, and a hub (a fake on 127.0.0.1) serving the repo
    import huggingface_hub.constants

    spec = ModelSpec.open(sharded)
    snapshot = hf_cache(sharded, tmp_path / "hub", REPO, spec.box_files([]))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with fake_hub(sharded, REPO, COMMIT) as (endpoint, downloaded):
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        # When a server loads blocks 2:4
        cached = ModelSpec.open(snapshot)
        output = span_output(cached, 2, 4)
    # Then only the shards of those blocks came down, and it computes what the whole checkpoint computes
    assert sorted(downloaded) == spec.files_for(spec.block_prefixes(2, 4))
    assert torch.equal(output, span_output(spec, 2, 4))


def test_a_hub_id_not_cached_downloads_its_small_files_and_manifest_but_no_weights_where_the_hub_is_reachable(
        sharded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with fake_hub(sharded, REPO, COMMIT, exclude=(MANIFEST_FILE,)) as (endpoint, downloaded):  # a repo as on the hub
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        snapshot = prepare_model(REPO, cache_dir=tmp_path / "models")
        spec = ModelSpec.open(snapshot)
        model_id = spec.model_id
        # the manifest was made from the hub's metadata (LFS sha256s, safetensors headers read by range), no weights
        assert (snapshot / MANIFEST_FILE).is_file() and not [n for n in downloaded if n.endswith(".safetensors")]
        ClientHead(spec, device="cpu")  # a worker: then only the head's shards come down
    assert snapshot == tmp_path / "hub" / "models--acme--tiny-sharded" / "snapshots" / COMMIT
    assert model_id == ModelSpec.open(sharded).model_id
    whole = ModelSpec.open(sharded)
    assert sorted(n for n in downloaded if n.endswith(".safetensors")) == whole.files_for(whole.head_prefixes)


@pytest.mark.swarm  # runs mount
@pytest.mark.skipif(os.geteuid() != 0, reason="a read-only bind mount needs root")
def test_a_read_only_model_dir_as_compose_mounts_it_serves_with_the_same_id(sharded: Path, tmp_path: Path) -> None:
    # a copy without the manifest file: the model id is computed from every file, and the digests cannot be cached
    source = Path(shutil.copytree(sharded, tmp_path / "whole"))
    (source / MANIFEST_FILE).unlink()
    for cached in source.glob(".swarmbatch-*"):
        cached.unlink()
    mounted = tmp_path / "ro"
    mounted.mkdir()
    subprocess.run(["mount", "--bind", str(source), str(mounted)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mounted)], check=True)
        spec = ModelSpec.open(mounted)
        assert spec.model_id == ModelSpec.open(sharded).model_id  # no EROFS from caching the digests
        assert torch.equal(span_output(spec, 2, 4), span_output(ModelSpec.open(sharded), 2, 4))
        assert sorted(p.name for p in mounted.iterdir()) == sorted(p.name for p in source.iterdir())
    finally:
        subprocess.run(["umount", str(mounted)], check=True)
