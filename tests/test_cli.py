"""The CLI through typer's runner: JSON shapes, one-line errors and documented exit codes."""
from __future__ import annotations

import importlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import cli
from commands.errors import EXIT_CODES, ExitCode
from launch.local_swarm import LocalSwarm
from launch.processes import ManagedProcess, cli_command
from launch.ready import SERVING_BLOCKS
from modelprep import write_tiny_model
from swarmclient.textgen import load_tokenizer
from swarmnet.errors import ModelDirError
from swarmnet.families import FAMILIES
from swarmnet.model_spec import ModelSpec

runner = CliRunner()
DEAD_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWCxbSVdL8unKt3Y4pzF1KX9GJLuq7DiGtDJwP5HhSaFRP"
ANNOUNCE_PERIOD = 3.0


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(cli.app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_model_tiny_writes_a_loadable_model(tmp_path: Path) -> None:
    code, out, _ = invoke("model", "tiny", str(tmp_path / "m"), "--layers", "2", "--arch", "qwen2")
    assert code == 0 and Path(out.strip()) == tmp_path / "m"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "m").config.num_hidden_layers == 2


def test_model_tiny_writes_shards_and_a_manifest_and_model_files_lists_what_each_box_needs(tmp_path: Path) -> None:
    code, _, _ = invoke("model", "tiny", str(tmp_path / "m"), "--layers", "4", "--shard-size", "60KB")
    spec = ModelSpec.open(tmp_path / "m")
    assert code == 0 and (tmp_path / "m" / "swarmbatch-manifest.json").is_file() and len(spec.manifest.files) > 4
    code, out, _ = invoke("model", "files", str(tmp_path / "m"), "--blocks", "0:2")
    listed = out.split()
    assert code == 0 and {"config.json", "tokenizer.json", "swarmbatch-manifest.json",
                          "model.safetensors.index.json"} <= set(listed)
    assert {file.name for name, file in spec.tensor_index.items() if name.startswith(("model.layers.0.",
                                                                                      "model.layers.1."))} <= set(listed)
    assert {file.name for file in spec.tensor_index.values()} - set(listed), "the later blocks' shards are not listed"
    code, out, _ = invoke("model", "files", str(tmp_path / "m"), "--head")
    assert code == 0 and spec.tensor_index["lm_head.weight"].name in out.split()
    code, _, err = invoke("model", "files", str(tmp_path / "m"))
    assert code == ExitCode.USAGE and "say which box" in err
    # model manifest remakes the same manifest (same id) where the whole checkpoint is
    (tmp_path / "m" / "swarmbatch-manifest.json").unlink()
    code, out, _ = invoke("model", "manifest", str(tmp_path / "m"), "--json")
    assert code == 0 and json.loads(out)["model_id"] == spec.model_id
    # and refuses, in one line, a directory that lacks shards and has no manifest
    (tmp_path / "m" / "swarmbatch-manifest.json").unlink()
    spec.tensor_index["lm_head.weight"].unlink()
    code, _, err = invoke("model", "manifest", str(tmp_path / "m"))
    assert code == ExitCode.USAGE and len(err.strip().splitlines()) == 1 and err.startswith("Error: ModelDirError:")


def test_an_unsupported_family_is_one_line_naming_the_supported_ones(tmp_path: Path) -> None:
    # model tiny of an unknown model_type
    code, _, err = invoke("model", "tiny", str(tmp_path / "m"), "--arch", "gpt2")
    assert code == ExitCode.USAGE and len(err.strip().splitlines()) == 1
    assert "'gpt2' is not supported" in err and all(name in err for name in FAMILIES)
    # serving a model dir of an unknown model_type: refused before anything starts
    model_dir = write_tiny_model(tmp_path / "bloom", layers=1)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "bloom"}))
    code, _, err = invoke("serve", str(model_dir), "--blocks", "0:1", "--initial-peers", DEAD_PEER)
    assert code == ExitCode.USAGE and len(err.strip().splitlines()) == 1
    assert "'bloom' is not supported" in err and all(name in err for name in FAMILIES)
    with pytest.raises(ModelDirError, match="'bloom' is not supported; supported: llama, mistral"):
        ModelSpec.open(model_dir)


def test_model_prepare_of_a_non_model_is_a_usage_error(tmp_path: Path) -> None:
    code, _, err = invoke("model", "prepare", str(tmp_path / "nothing-here"))
    assert code == ExitCode.USAGE and err.startswith("Error: ModelPrepError:") and len(err.strip().splitlines()) == 1


def test_every_error_class_the_boundary_maps_exists() -> None:
    # the boundary names classes instead of importing them: a renamed or moved class must fail here, not in the field
    for name in EXIT_CODES:
        module, _, qualname = name.rpartition(".")
        kind = getattr(importlib.import_module(module), qualname, None)
        assert isinstance(kind, type) and issubclass(kind, Exception), name


def test_an_error_of_ours_prints_its_traceback_only_with_verbose(tmp_path: Path) -> None:
    plain = runner.invoke(cli.app, ["model", "prepare", str(tmp_path / "nothing-here")])
    verbose = runner.invoke(cli.app, ["--verbose", "model", "prepare", str(tmp_path / "nothing-here")])
    assert plain.exit_code == verbose.exit_code == ExitCode.USAGE
    assert "Traceback" not in plain.stderr and len(plain.stderr.strip().splitlines()) == 1
    assert "Traceback (most recent call last):" in verbose.stderr and "prepare_model" in verbose.stderr
    assert verbose.stderr.strip().splitlines()[-1] == plain.stderr.strip()


def test_generate_json_prints_texts_and_token_ids(tiny_model: Path, shared_swarm: LocalSwarm) -> None:
    # two micro-batches of one prompt each, run at once (pipelined over the two servers)
    code, out, err = invoke("generate", str(tiny_model), "Hello world", "The quick brown fox", "--max-new-tokens", "12",
                            "--json", "--micro-batches", "2", "--initial-peers", *shared_swarm.initial_peers)
    assert code == 0, err
    outputs = json.loads(out)["outputs"]
    assert [o["prompt"] for o in outputs] == ["Hello world", "The quick brown fox"]
    tokenizer = load_tokenizer(tiny_model)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    for item in outputs:
        encoded = tokenizer(item["prompt"], return_tensors="pt")
        with torch.inference_mode():
            expected = reference.generate(**encoded, max_new_tokens=12, do_sample=False)[0, encoded.input_ids.shape[1]:]
        assert item["token_ids"] == expected.tolist()[: len(item["token_ids"])]
        assert item["text"] == tokenizer.decode(item["token_ids"], skip_special_tokens=True)


def test_generate_with_verify_fraction_counts_the_steps_no_second_server_could_check(
        tiny_model: Path, shared_swarm: LocalSwarm) -> None:
    # the shared swarm holds each half once: every sampled step has no second holder
    code, out, err = invoke("generate", str(tiny_model), "Hello world", "--max-new-tokens", "6", "--json",
                            "--verify-fraction", "1", "--initial-peers", *shared_swarm.initial_peers)
    assert code == 0, err
    checks = json.loads(out)["verification"]
    assert checks["steps_verified"] == checks["mismatches"] == 0 and checks["steps_unverified"] >= 2
    code, _, err = invoke("generate", str(tiny_model), "Hello world", "--max-new-tokens", "6",
                          "--verify-fraction", "1", "--initial-peers", *shared_swarm.initial_peers)
    assert code == 0 and re.search(r"^0 steps verified on a second server, 0 mismatches, \d+ sampled steps without a "
                                   r"second server$", err, re.M), err
    code, _, err = invoke("generate", str(tiny_model), "hi", "--verify-fraction", "2", "--initial-peers", DEAD_PEER)
    assert code == ExitCode.USAGE and "--verify-fraction" in err


@pytest.mark.swarm  # its client starts a p2pd
def test_generate_with_an_unreachable_dht_exits_4_with_one_line(tiny_model: Path) -> None:
    code, _, err = invoke("generate", str(tiny_model), "hi", "--initial-peers", DEAD_PEER)
    assert code == ExitCode.SWARM_UNAVAILABLE
    assert err.startswith("Error: DHTUnreachable:") and len(err.strip().splitlines()) == 1


def test_serve_rejects_a_malformed_block_range(tiny_model: Path) -> None:
    code, _, err = invoke("serve", str(tiny_model), "--blocks", "3-5", "--initial-peers", DEAD_PEER)
    assert code == ExitCode.USAGE and "START:END" in err


def test_serve_refuses_an_announce_period_above_the_swarm_limit(tiny_model: Path) -> None:
    code, _, err = invoke("serve", str(tiny_model), "--blocks", "0:3", "--announce-period", "31",
                          "--initial-peers", DEAD_PEER)
    assert code == ExitCode.USAGE and len(err.strip().splitlines()) == 1
    assert err.startswith("Error: ServerConfigError: --announce-period 31 is above the swarm's limit of 30 s")


def test_a_node_with_a_key_file_that_is_not_a_key_exits_2_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "junk.key").write_bytes(b"not a key")
    code, _, err = invoke("dht", "--identity", str(tmp_path / "junk.key"))
    assert code == ExitCode.USAGE and len(err.strip().splitlines()) == 1
    assert err.startswith("Error: IdentityError: ") and "junk.key is not a swarmbatch/libp2p key file" in err


def test_serve_takes_one_span_option_not_both(tiny_model: Path, shared_swarm: LocalSwarm) -> None:
    # (neither: the server sizes its span by memory, tests/servers/test_block_sizing.py)
    code, _, err = invoke("serve", str(tiny_model), "--blocks", "0:2", "--num-blocks", "2",
                          "--initial-peers", *shared_swarm.initial_peers)
    assert code == ExitCode.USAGE and "pass one of --blocks A:B and --num-blocks N" in err


def test_a_server_with_num_blocks_fills_the_least_covered_span(tiny_model: Path, local_swarm) -> None:
    swarm = local_swarm(tiny_model, [(0, 3)])
    chooser = ManagedProcess(cli_command("serve", str(tiny_model), "--num-blocks", "3", "--num-threads", "1",
                                         "--initial-peers", *swarm.initial_peers), name="chooser", log_dir=swarm.log_dir)
    try:
        line = chooser.wait_for_line(SERVING_BLOCKS, timeout=120)
    finally:
        chooser.terminate()
    assert line.startswith(f"{SERVING_BLOCKS} 3:6 ")


def test_swarm_status_shows_a_leaving_server_as_missing_within_one_announce_period(
        tiny_model: Path, local_swarm) -> None:
    swarm = local_swarm(tiny_model, [(0, 3), (3, 6)], server_args=["--announce-period", str(ANNOUNCE_PERIOD)])
    code, out, _ = invoke("swarm", "status", str(tiny_model), "--json", "--initial-peers", *swarm.initial_peers)
    report = json.loads(out)
    assert code == 0 and report["complete"] and report["missing"] == []
    assert all(len(block["servers"]) == 1 for block in report["blocks"])
    # When the second server leaves
    swarm.servers[1].terminate()
    left_at = time.monotonic()
    while True:
        report = json.loads(invoke("swarm", "status", str(tiny_model), "--json", "--initial-peers",
                                   *swarm.initial_peers)[1])
        if report["missing"] or time.monotonic() - left_at > ANNOUNCE_PERIOD:
            break
    # Then its blocks show as missing within one announce period
    assert report["missing"] == [[3, 6]] and not report["complete"]
    assert {s["state"] for s in report["blocks"][4]["servers"]} <= {"offline"}
    code, text, _ = invoke("swarm", "status", str(tiny_model), "--initial-peers", *swarm.initial_peers)
    assert "Missing blocks 3:6" in text


@pytest.mark.swarm
def test_the_dht_exits_when_its_whole_process_group_gets_sigterm(tmp_path: Path) -> None:
    # Ctrl-C in a terminal and `kill -- -PGID` reach p2pd too; the node must not wait for the dead daemon
    dht = ManagedProcess(cli_command("dht", "--host", "127.0.0.1"), name="dht", log_dir=tmp_path)
    try:
        dht.wait_for_line("/ip4/127.0.0.1/", timeout=60)
        os.killpg(dht.pid, signal.SIGTERM)
        assert dht.proc.wait(timeout=15) == 0
    finally:
        dht.kill()


def test_version_is_the_installed_package_s_which_is_pyproject_s() -> None:
    import tomllib

    code, out, _ = invoke("--version")
    version = tomllib.loads((Path(cli.__file__).parent / "pyproject.toml").read_text())["project"]["version"]
    assert code == 0 and out == f"swarmbatch {version}\n"
