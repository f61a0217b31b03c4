"""Real servers whose boxes hold only their span's shards (and a client only the head's) generate what transformers
generates on the whole model; a server of other weights is never mixed in; an altered shard stops a server."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from generation_checks import reference_tokens
from model_boxes import box_copy
from test_swarm_generation import PROMPTS

from launch.processes import cli_command
from modelprep import write_tiny_model
from swarmclient.coverage import read_coverage
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.textgen import load_tokenizer
from swarmnet.model_spec import ModelSpec


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 4-layer Llama in shards of at most 60 KB, with its manifest."""
    return write_tiny_model(tmp_path_factory.mktemp("span-on-disk") / "m", layers=4, seed=7, shard_size="60KB",
                            manifest=True)


def test_servers_holding_only_their_shards_generate_what_transformers_generates_and_other_weights_never_mix(
        sharded: Path, tmp_path: Path, local_swarm) -> None:
    # Given boxes that hold only what they serve: blocks 0:2, blocks 2:4, the client's head; and a box of other
    # weights (same architecture and file names) that serves blocks 2:4
    other = write_tiny_model(tmp_path / "other", layers=4, seed=8, shard_size="60KB", manifest=True)
    first, second = box_copy(sharded, tmp_path / "s0", blocks=(0, 2)), box_copy(sharded, tmp_path / "s1", blocks=(2, 4))
    client = box_copy(sharded, tmp_path / "client", head=True)
    stranger = box_copy(other, tmp_path / "stranger", blocks=(2, 4))
    swarm = local_swarm(first, [(0, 2)])
    swarm.start_server(2, 4, model_dir=stranger)
    # When the client reads the swarm, Then the other weights' server does not cover its blocks
    report = read_coverage(client, swarm.initial_peers)
    assert report["model_id"] == ModelSpec.open(sharded).model_id != ModelSpec.open(other).model_id
    assert report["missing"] == [[2, 4]]
    # When a server of the right weights joins, Then the client generates transformers' greedy tokens on the whole model
    swarm.start_server(2, 4, model_dir=second)
    batch = load_tokenizer(client)(PROMPTS, return_tensors="pt", padding=True)
    with DistributedModelForCausalLM.from_pretrained(client, initial_peers=swarm.initial_peers) as model:
        got = model.generate(batch.input_ids, batch.attention_mask, max_new_tokens=24)
    assert torch.equal(got[:, batch.input_ids.shape[1]:], reference_tokens(sharded, batch, 24))


def test_a_server_given_a_shard_altered_by_one_byte_exits_with_one_line(sharded: Path, tmp_path: Path,
                                                                         local_swarm) -> None:
    swarm = local_swarm(sharded, [])
    box = box_copy(sharded, tmp_path / "box", blocks=(0, 2))
    altered = box / ModelSpec.open(box).files_for(["model.layers.1."])[-1]
    data = bytearray(altered.read_bytes())
    data[len(data) // 2] ^= 0x01
    altered.write_bytes(bytes(data))
    proc = subprocess.run(cli_command("serve", str(box), "--blocks", "0:2", "--initial-peers", *swarm.initial_peers),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith(f"Error: ModelDirError: {altered} has sha256 "), proc.stderr
