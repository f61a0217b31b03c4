"""A private swarm with real processes: members generate as in an open swarm; an outsider's server is never used,
though routing would prefer it; an outsider's client is refused on every RPC before the server reserves anything."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind.p2p import PeerID
from jobs_support import job_status, wait_for
from raw_streams import close, ended, error_code, exchange, framed, raw_stream
from tiers import process_fixture
from typer.testing import CliRunner

import cli
from commands.errors import ExitCode
from jobs.runtime import Runtime
from jobs.submission import submit_batch
from launch.local_swarm import LocalSwarm
from launch.local_worker import settings_env
from launch.processes import ManagedProcess, cli_command
from launch.ready import SERVING_BLOCKS
from servers.throughput import TEST_OVERSTATE_ENV
from swarmclient.config import ClientConfig
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.session import InferenceSession
from swarmclient.swarm import Swarm
from swarmclient.textgen import load_tokenizer
from swarmnet import protocol
from swarmnet.identity import Identity
from swarmnet.membership import (
    CLIENT,
    RECHECK_SECONDS,
    MemberCredential,
    Membership,
    NotAMember,
    SwarmAccess,
    SwarmFile,
)
from swarmnet.model_spec import ModelSpec

PROMPTS = ["Hello world, this is", "The quick brown fox"]
runner = CliRunner()


@process_fixture(scope="module")
def private_swarm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    """Members: a DHT node and two servers (0:3, 3:6) announcing a hundredth of what they measured. Outsider: a
    server of all six blocks with its own key, not in the swarm file, announcing ten thousand times what it measured:
    a shortest path ignoring membership takes it (test_routing_would_prefer_the_outsider_if_membership_were_ignored
    checks that it does). Both factors matter: at their true speeds the members' chain costs the tiny model's ~13 ms
    of compute and two round trips against the outsider's one, so a ping slowed by a loaded machine could tip it."""
    with LocalSwarm(tiny_model, [], log_dir=tmp_path_factory.mktemp("private"), private=True) as swarm:
        fast, slow = {TEST_OVERSTATE_ENV: "10000"}, {TEST_OVERSTATE_ENV: "0.01"}
        started = [swarm.start_server(0, 3, wait=False, env=slow), swarm.start_server(3, 6, wait=False, env=slow),
                   swarm.start_server(0, 6, wait=False, env=fast, member=False)]
        for server in started:
            server.wait_for_line(SERVING_BLOCKS, timeout=swarm.ready_timeout)
        yield swarm


def outsider(swarm: LocalSwarm) -> str:
    return swarm.servers[2].peer_id


def members(swarm: LocalSwarm) -> list[str]:
    return [swarm.servers[0].peer_id, swarm.servers[1].peer_id]


@process_fixture(scope="module")
def member_client(tiny_model: Path, private_swarm: LocalSwarm) -> Iterator[Swarm]:
    spec = ModelSpec.open(tiny_model)
    client = Swarm.connect(private_swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks,
                           access=private_swarm.access())
    yield client
    client.close()


@process_fixture(scope="module")
def raw_client(tiny_model: Path, private_swarm: LocalSwarm) -> Iterator[Swarm]:
    """A client with no membership at all: it sends whatever credential a test gives it."""
    spec = ModelSpec.open(tiny_model)
    client = Swarm.connect(private_swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks)
    yield client
    client.close()


def generate(model_dir: Path, initial_peers: list[str], access: SwarmAccess | None, *, verify_fraction: float = 0.0
             ) -> tuple[torch.Tensor, Swarm]:
    batch = load_tokenizer(model_dir)(PROMPTS, return_tensors="pt", padding=True)
    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=initial_peers, access=access,
                                                     config=ClientConfig(verify_fraction=verify_fraction)) as model:
        return model.generate(batch.input_ids, batch.attention_mask, max_new_tokens=12), model.swarm


def steps_of(client: Swarm, peer: str) -> int:
    return int(client.loop.run(client.call_info(peer))["steps"])  # type: ignore[call-overload]


# ---- members -------------------------------------------------------------------------------------------------------
def test_a_member_client_generates_the_same_tokens_as_in_an_open_swarm(
        tiny_model: Path, private_swarm: LocalSwarm, shared_swarm: LocalSwarm, member_client: Swarm) -> None:
    outsider_steps = steps_of(member_client, outsider(private_swarm))
    private, swarm = generate(tiny_model, private_swarm.initial_peers, private_swarm.access())
    open_, _ = generate(tiny_model, shared_swarm.initial_peers, None)
    assert torch.equal(private, open_)
    assert set(swarm.rtts) == set(members(private_swarm)), "the outsider was never even pinged"
    assert steps_of(member_client, outsider(private_swarm)) == outsider_steps


def test_checked_outputs_are_never_recomputed_on_a_non_member(tiny_model: Path, private_swarm: LocalSwarm,
                                                              member_client: Swarm) -> None:
    # the outsider is the only other holder of each member's blocks: a check would send it the hops' whole history
    outsider_steps = steps_of(member_client, outsider(private_swarm))
    generate(tiny_model, private_swarm.initial_peers, private_swarm.access(), verify_fraction=1.0)
    assert steps_of(member_client, outsider(private_swarm)) == outsider_steps


def test_routing_would_prefer_the_outsider_if_membership_were_ignored(
        tiny_model: Path, private_swarm: LocalSwarm, member_client: Swarm) -> None:
    # the control run of the test above: the same swarm, a client without the swarm file (and with the member key,
    # so that only the routing filter differs) goes through the outsider, whose announced speed wins
    access = SwarmAccess(Membership.open(), Identity.load(private_swarm.client_key))
    before = steps_of(member_client, outsider(private_swarm))
    _, swarm = generate(tiny_model, private_swarm.initial_peers, access)
    assert steps_of(member_client, outsider(private_swarm)) > before


def test_the_route_of_a_member_client_holds_members_only(tiny_model: Path, private_swarm: LocalSwarm,
                                                         member_client: Swarm) -> None:
    with InferenceSession(member_client, batch_size=1, max_length=16) as session:
        assert {hop.peer_id for hop in session.route} == set(members(private_swarm))


def test_swarm_status_marks_the_outsider_and_counts_members_only(tiny_model: Path, private_swarm: LocalSwarm) -> None:
    args = ["swarm", "status", str(tiny_model), "--initial-peers", *private_swarm.initial_peers,
            "--swarm-file", str(private_swarm.swarm_file)]
    result = runner.invoke(cli.app, [*args, "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    membership = {s["peer_id"]: s["member"] for block in report["blocks"] for s in block["servers"]}
    assert membership == {outsider(private_swarm): False, **dict.fromkeys(members(private_swarm), True)}
    assert report["complete"] and report["access"]["private"]
    text = runner.invoke(cli.app, [*args, "--identity", str(private_swarm.client_key)]).stdout
    assert text.count("not a member (ignored)") == 6 and "All blocks are served." in text
    assert f"this key {Identity.load(private_swarm.client_key).peer_id} is a member" in text
    opened = json.loads(runner.invoke(cli.app, [*args[:-2], "--json"]).stdout)  # no swarm file: everyone counts
    assert all(s["member"] for block in opened["blocks"] for s in block["servers"])


# ---- outsiders' clients ----------------------------------------------------------------------------------------------
def call(client: Swarm, peer: str, rpc: str, frames: list[bytes]) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """A raw request on its own stream, as any peer can send it (the client's own `_call`: no credential added)."""
    return client.loop.run(client._call(peer, rpc, frames, timeout=30, max_answer=1 << 24))


def info_call(client: Swarm, peer: str, meta: dict[str, Any]) -> dict[str, Any]:
    return call(client, peer, protocol.RPC_INFO, [protocol.encode([], meta)])[1]


def forward_call(client: Swarm, peer: str, tensors: list[torch.Tensor], meta: dict[str, Any]
                 ) -> tuple[list[torch.Tensor], dict[str, Any]]:
    hidden = tensors[0]
    header = {"start": 0, "end": 3, "batch_size": hidden.shape[0], "length": hidden.shape[1], "dtype": "float32", **meta}
    return call(client, peer, protocol.RPC_FORWARD, [protocol.encode([], header), protocol.encode(tensors)])


def open_meta(session_id: str, meta: dict[str, Any]) -> dict[str, Any]:
    return {"open": True, "session_id": session_id, "start": 0, "end": 3, "batch_size": 1, "max_length": 64, **meta}


class Stream:
    """A raw inference stream of `client` to a server: send one message, read its answer."""

    rpc = protocol.RPC_INFERENCE

    def __init__(self, client: Swarm, peer: str) -> None:
        self.client = client
        _, self.reader, self.writer = client.loop.run(
            client.p2p.call_binary_stream_handler(PeerID.from_base58(peer), self.rpc))

    def send(self, tensors: list[torch.Tensor], meta: dict[str, Any]) -> tuple[list[torch.Tensor], dict[str, Any]]:
        async def exchange() -> bytes:
            protocol.write_frame(self.writer, protocol.encode(tensors, meta))
            await self.writer.drain()
            return await protocol.read_frame(self.reader, 1 << 24)
        return protocol.decode(self.client.loop.run(exchange()))

    def close(self) -> None:
        self.client.loop.loop.call_soon_threadsafe(self.writer.close)


class PushStream(Stream):
    """A raw push stream, as servers open them to the next hop."""

    rpc = protocol.RPC_PUSH


def step_inputs(hidden_size: int, length: int = 4) -> list[torch.Tensor]:
    return [torch.randn(1, length, hidden_size), torch.ones(1, length, dtype=torch.long), torch.arange(length)[None]]


def credential_meta(case: str, swarm: LocalSwarm, raw: Swarm, member_client: Swarm) -> dict[str, Any]:
    """meta of a client that proves nothing, in each way an outsider might try."""
    me, now = raw.p2p.peer_id.to_base58(), int(time.time())
    member = Identity.load(swarm.client_key)
    if case == "none":
        return {}
    if case == "an outsider's key":
        stranger = Identity.load_or_create(swarm.log_dir / "keys" / "stranger.key")
        return {"credential": MemberCredential.issue(stranger, me, now + 3600).to_bytes()}
    if case == "made for another peer":  # a member client's credential, copied off the wire
        return {"credential": MemberCredential.issue(member, member_client.p2p.peer_id.to_base58(),
                                                     now + 3600).to_bytes()}
    assert case == "expired"
    return {"credential": MemberCredential.issue(member, me, now - 60).to_bytes()}


@pytest.mark.parametrize("case", ["none", "an outsider's key", "made for another peer", "expired"])
def test_a_client_that_proves_no_membership_is_refused_on_every_rpc_and_nothing_is_reserved(
        tiny_model: Path, private_swarm: LocalSwarm, raw_client: Swarm, member_client: Swarm, case: str) -> None:
    peer, hidden_size = members(private_swarm)[0], ModelSpec.open(tiny_model).hidden_size
    meta = credential_meta(case, private_swarm, raw_client, member_client)
    before = member_client.loop.run(member_client.call_info(peer))
    answers = [info_call(raw_client, peer, meta), forward_call(raw_client, peer, step_inputs(hidden_size), meta)[1]]
    stream = Stream(raw_client, peer)
    try:
        answers.append(stream.send([], open_meta("s" * 32, meta))[1])
        during = member_client.loop.run(member_client.call_info(peer))  # the refused stream is still open
    finally:
        stream.close()
    for answer in answers:
        code, message = protocol.response_error(answer) or (None, "")
        assert code is protocol.ErrorCode.UNAUTHORIZED and "\n" not in message, (case, answer)
    assert during["sessions"] == 0 and during["cache_tokens_left"] == before["cache_tokens_left"]
    assert during["steps"] == before["steps"], "nothing was computed"
    assert during["errors"]["unauthorized"] == before["errors"].get("unauthorized", 0) + 3


def test_a_valid_credential_opens_all_three(tiny_model: Path, private_swarm: LocalSwarm, raw_client: Swarm,
                                            member_client: Swarm) -> None:
    # the positive control of the test above: the same raw requests with the credential a member client sends
    peer, hidden_size = members(private_swarm)[0], ModelSpec.open(tiny_model).hidden_size
    meta = SwarmAccess.load(private_swarm.swarm_file, private_swarm.client_key).credential(
        raw_client.p2p.peer_id.to_base58())
    assert meta is not None
    assert protocol.response_error(info_call(raw_client, peer, {"credential": meta})) is None
    tensors, answer = forward_call(raw_client, peer, step_inputs(hidden_size), {"credential": meta})
    assert protocol.response_error(answer) is None and tensors[0].shape == (1, 4, hidden_size)
    stream = Stream(raw_client, peer)
    try:
        _, opened = stream.send([], open_meta("v" * 32, {"credential": meta}))
        assert protocol.response_error(opened) is None and opened.get("opened")
        _, answer = stream.send(step_inputs(hidden_size), {"session_id": "v" * 32})
        assert protocol.response_error(answer) is None and answer["cache_len"] == 4
        assert member_client.loop.run(member_client.call_info(peer))["sessions"] == 1
    finally:
        stream.close()


def test_a_key_outside_the_servers_swarm_file_gets_one_line_naming_add_member(
        tiny_model: Path, private_swarm: LocalSwarm, tmp_path: Path) -> None:
    key = Identity.create(tmp_path / "laptop.key")
    mine = SwarmFile.load(private_swarm.swarm_file)  # the client's copy lists its key; the servers' does not
    mine.path = tmp_path / "swarm.json"
    mine.add(key.peer_id, "laptop")
    mine.save()
    result = runner.invoke(cli.app, ["generate", str(tiny_model), "hi", "--max-new-tokens", "2", "--initial-peers",
                                     *private_swarm.initial_peers, "--swarm-file", str(mine.path),
                                     "--identity", str(key.path)])
    assert result.exit_code == ExitCode.USAGE
    assert result.stderr.startswith("Error: NotAMember: not a member of the swarm: servers ")
    assert f"add this key's peer id with 'swarmbatch swarm add-member SWARM_FILE {key.peer_id}'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_removed_member_is_refused_once_the_servers_see_the_file(
        tiny_model: Path, private_swarm: LocalSwarm, tmp_path: Path) -> None:
    assert private_swarm.swarm_file is not None
    key = Identity.load(private_swarm.new_member("leaver", CLIENT))
    stale = Membership(None, {**SwarmFile.load(private_swarm.swarm_file).members})  # a box whose copy is old
    time.sleep(RECHECK_SECONDS)  # the servers see the new member
    tokens, _ = generate(tiny_model, private_swarm.initial_peers, SwarmAccess(stale, key))
    assert tokens.shape[1] > 0
    swarm = SwarmFile.load(private_swarm.swarm_file)
    swarm.remove("leaver")
    swarm.save()
    time.sleep(RECHECK_SECONDS)  # running servers re-read the file at most this often
    with pytest.raises(NotAMember, match="not a member of the swarm"):
        generate(tiny_model, private_swarm.initial_peers, SwarmAccess(stale, key))


# ---- a worker's pool processes -------------------------------------------------------------------------------------
def test_a_workers_pool_processes_generate_as_members(make_runtime, private_swarm: LocalSwarm, tiny_model: Path,
                                                      member_client: Swarm, tmp_path: Path) -> None:
    # two pool processes, each with its own peer id and a credential of the one member key
    runtime: Runtime = make_runtime(initial_peers=private_swarm.initial_peers, swarm_file=private_swarm.swarm_file,
                                    identity=private_swarm.client_key)
    outsider_steps = steps_of(member_client, outsider(private_swarm))
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"Item {i} is", "max_tokens": 6, "temperature": 0}}) for i in range(2)]
    jobs = [submit_batch(runtime, ("\n".join(lines) + "\n").encode(), model=str(tiny_model)) for _ in range(2)]
    worker = ManagedProcess(cli_command("worker", "--concurrency", "2"), name="worker", log_dir=tmp_path,
                            env=settings_env(runtime.settings))
    try:
        for job in jobs:
            wait_for(lambda job=job: job_status(runtime, job.id) == "completed", 180, f"job {job.id}")
    finally:
        worker.terminate()
    assert steps_of(member_client, outsider(private_swarm)) == outsider_steps


# ---- what a stranger's messages cost a server (security audit 2, N10, N11, N15) ---------------------------------
def refusal_lines(server: ManagedProcess, peer_id: str) -> list[str]:
    """The server's log lines about refusing `peer_id`."""
    return [line for line in server.log_path.read_text(errors="replace").splitlines()
            if "Refused a request of" in line and peer_id[-8:] in line]


def test_a_strangers_stream_ends_at_its_first_refusal_and_is_logged_once_however_many_it_opens(
        private_swarm: LocalSwarm, raw_client: Swarm) -> None:
    server = private_swarm.servers[0]
    me = raw_client.p2p.peer_id.to_base58()
    for _ in range(5):
        stream = raw_stream(raw_client, server.peer_id)
        # a credential whose text forges a log line: it is logged escaped, never as a line of its own
        meta = exchange(raw_client, stream, framed([], open_meta("t" * 32, {"credential": {"peer": "x\nINFO forged"}})))
        assert error_code(meta) is protocol.ErrorCode.UNAUTHORIZED
        assert ended(raw_client, stream, timeout=10)  # the server reads nothing more from it
        close(raw_client, stream)
    lines = refusal_lines(server, me)
    assert len(lines) == 1, lines
    assert not any(line.startswith("INFO forged") for line in server.log_path.read_text().splitlines())


def test_a_first_message_of_twenty_thousand_unknown_ext_objects_is_refused_unlogged_as_invalid(
        private_swarm: LocalSwarm, raw_client: Swarm) -> None:
    server = private_swarm.servers[1]
    # msgpack: a map {"meta": [20,000 x ext type 0x51 holding {}], "tensors": []}; hivemind's hook logged each ext
    bomb = b"\x82\xa4meta\xdd" + (20_000).to_bytes(4, "big") + b"\xd4\x51\x80" * 20_000 + b"\xa7tensors\x90"
    before = len(server.log_path.read_text(errors="replace").splitlines())
    stream = raw_stream(raw_client, server.peer_id)
    meta = exchange(raw_client, stream, protocol.length_prefixed(len(bomb).to_bytes(4, "big") + bomb))
    assert error_code(meta) is protocol.ErrorCode.INVALID
    close(raw_client, stream)
    assert len(server.log_path.read_text(errors="replace").splitlines()) - before <= 1


# ---- roles: a client's key never serves ----------------------------------------------------------------------------
@process_fixture()
def swarm_with_a_client_key_server(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[LocalSwarm, ManagedProcess]]:
    """Server members on 0:3 and 3:6, and a server of all six blocks run with a key the swarm file lists as a client
    (its own copy is open, so it starts), announcing ten thousand times what it measured."""
    with LocalSwarm(tiny_model, [], log_dir=tmp_path, private=True) as swarm:
        laptop = swarm.new_member("laptop", CLIENT)
        started = [swarm.start_server(0, 3, wait=False), swarm.start_server(3, 6, wait=False),
                   swarm.start_server(0, 6, wait=False, env={TEST_OVERSTATE_ENV: "10000"}, member=False,
                                      extra_args=["--identity", str(laptop)])]  # the last --identity wins
        for server in started:
            server.wait_for_line(SERVING_BLOCKS, timeout=swarm.ready_timeout)
        assert started[2].peer_id == Identity.load(laptop).peer_id
        yield swarm, started[2]


def test_a_server_run_with_a_client_members_key_is_neither_routed_nor_pushed_to(
        tiny_model: Path, swarm_with_a_client_key_server: tuple[LocalSwarm, ManagedProcess]) -> None:
    swarm, laptop = swarm_with_a_client_key_server
    servers = [swarm.servers[0].peer_id, swarm.servers[1].peer_id]
    spec = ModelSpec.open(tiny_model)
    client = Swarm.connect(swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks,
                           access=swarm.access())
    try:
        assert laptop.peer_id in {p for block in client.loop.run(client.block_infos(refresh=True)) for p in block}
        before = steps_of(client, laptop.peer_id)
        # a member client routes through the server members only, although the client key's server claims more speed
        tokens, model_swarm = generate(tiny_model, swarm.initial_peers, swarm.access(), verify_fraction=1.0)
        assert tokens.shape[1] > 0 and set(model_swarm.rtts) == set(servers)
        assert steps_of(client, laptop.peer_id) == before
        # and a member server refuses to push a session's steps to it
        credential = {"credential": swarm.access().credential(client.p2p.peer_id.to_base58())}
        stream = Stream(client, servers[0])
        try:
            _, opened = stream.send([], open_meta("p" * 32, {**credential, "push": True}))
            assert protocol.response_error(opened) is None
            _, answer = stream.send(step_inputs(spec.hidden_size), {
                "session_id": "p" * 32, "step_id": 0, "route": [[laptop.peer_id, "q" * 32]]})
            code, message = protocol.response_error(answer) or (None, "")
            assert code is protocol.ErrorCode.UNAUTHORIZED and "pushes to members of its swarm only" in message
            # and a client (a member's credential) cannot push into a session either: only server members do
            push = PushStream(client, servers[0])
            try:
                _, attached = push.send([], {"attach": True, "session_id": "p" * 32, **credential})
                code, message = protocol.response_error(attached) or (None, "")
                assert code is protocol.ErrorCode.UNAUTHORIZED and "takes pushes from the server members" in message
            finally:
                push.close()
        finally:
            stream.close()
    finally:
        client.close()
