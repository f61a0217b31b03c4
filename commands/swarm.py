"""Swarm commands: prepare models, run the DHT node and block servers, read the swarm, generate, the demo; the
members of a private swarm (swarm init / new-key / add-member / remove-member / members)."""
from __future__ import annotations

import json
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from commands.config_options import config_values, with_config_options
from commands.options import (
    AnnounceHostOption,
    HostOption,
    JsonOption,
    MemberKeyOption,
    PeersOption,
    PortOption,
    RelayOption,
    SwarmFileOption,
    UseRelayOption,
)
from launch.ready import serving_line
from servers.config import ServerConfig  # light: no torch, no hivemind (its options are built at import)

app = typer.Typer()  # top-level verbs: dht, serve, generate, demo
model_app = typer.Typer(help="Prepare model directories.", no_args_is_help=True)
swarm_app = typer.Typer(help="Inspect the swarm; manage a private swarm's members.", no_args_is_help=True)


def resolve_model(name_or_path: str) -> Path:
    """'smollm2' or a local model dir -> a prepared model directory."""
    from jobs.settings import get_settings
    from modelprep import prepare_model

    return prepare_model(name_or_path, cache_dir=get_settings().models_dir)


def network_options(host: str, port: int, identity: Path | None, announce_host: str | None = None, *,
                    relay: bool = False, use_relay: bool = False) -> Any:
    """The P2P listen options of a DHT node or block server (--relay: relays for members; --use-relay: behind NAT)."""
    from swarmnet.addresses import NetworkOptions
    from swarmnet.relays import RelayRole

    if relay and use_relay:
        raise typer.BadParameter("a node behind NAT cannot relay for others: give --relay or --use-relay, not both",
                                 param_hint="--use-relay")
    role = RelayRole.relay if relay else RelayRole.behind_nat if use_relay else RelayRole.none
    return NetworkOptions(host=host, port=port, identity_path=str(identity) if identity else None,
                          announce_host=announce_host or None, relay_role=role)


def client_access(swarm_file: Path | None, identity: Path | None, *, strict: bool = True) -> Any:
    """A client's SwarmAccess from --swarm-file and --identity (one-line errors for a bad file or a missing key)."""
    from swarmnet.membership import SwarmAccess

    return SwarmAccess.load(swarm_file, identity, strict=strict)


def server_membership(role: str, host: str, swarm_file: Path | None, identity: Path | None) -> Any:
    """The Membership of a DHT node or server; warns on stderr when it listens beyond loopback with none.
    `host` has passed `network_options` (an IP address)."""
    from swarmnet.addresses import listen_ip
    from swarmnet.membership import Membership, MembershipError

    if swarm_file is None:
        if not listen_ip(host).is_loopback:
            typer.echo(f"Warning: this {role} listens on {host} without --swarm-file: anyone who can reach its port "
                       "can join the swarm, announce blocks and be sent hidden states (the prompts); make the swarm "
                       "private with 'swarmbatch swarm init' (docs/deploying.md: Several machines)", err=True)
        return Membership.open()
    if identity is None:
        raise MembershipError(f"a {role} of a private swarm (--swarm-file) needs --identity KEYFILE: a key whose peer id "
                              "is in the swarm file ('swarmbatch swarm new-key', then add-member)")
    return Membership.from_file(swarm_file)


# ---- model -------------------------------------------------------------------------------------------------
MODEL_HELP = "'smollm2', a local model dir, or a Hugging Face id (org/name[@revision]) in the hub cache."


@model_app.command("prepare")
def model_prepare(name_or_path: Annotated[str, typer.Argument(help=MODEL_HELP)]) -> None:
    """Make a local model directory (safetensors + tokenizer) and print its path (a Hugging Face id: its snapshot
    in the hub cache; where the hub is reachable, HF_HUB_OFFLINE=0, its small files and manifest, no weights)."""
    typer.echo(resolve_model(name_or_path))


@model_app.command("manifest")
def model_manifest(model_dir: Annotated[Path, typer.Argument(help="A directory holding the whole checkpoint.")],
                   as_json: JsonOption = False) -> None:
    """Write swarmbatch-manifest.json (each weight file's sha256 and tensors) where the whole checkpoint is; copied
    with the config, it lets a box hold only the files it serves. Prints the model id."""
    from swarmnet.manifest import write_manifest
    from swarmnet.model_spec import ModelSpec

    path = write_manifest(ModelSpec.open(model_dir).path)
    spec = ModelSpec.open(model_dir)
    files = spec.manifest.files
    if as_json:
        typer.echo(json.dumps({"manifest": str(path), "model_id": spec.model_id, "files": len(files),
                               "bytes": sum(entry.size for entry in files.values())}))
        return
    typer.echo(f"{path}: {len(files)} weight files, {sum(e.size for e in files.values())} bytes; "
               f"model id {spec.model_id}")


@model_app.command("files")
def model_files(model_dir: Annotated[Path, typer.Argument(help="A model directory with its manifest.")],
                blocks: Annotated[str | None, typer.Option(help="A server of blocks START:END.")] = None,
                head: Annotated[bool, typer.Option("--head", help="A client: embeddings, final norm, LM head.")] = False,
                ) -> None:
    """Print, one per line, the files a box needs: a server of --blocks, or a client (--head), or both."""
    from swarmnet.model_spec import ModelSpec

    spec = ModelSpec.open(model_dir)
    span = parse_blocks(blocks)
    if span is None and not head:
        raise typer.BadParameter("say which box: --blocks START:END (a server), --head (a client), or both",
                                 param_hint="--blocks / --head")
    if span and span[1] > spec.num_blocks:
        raise typer.BadParameter(f"the model has blocks 0:{spec.num_blocks}", param_hint="--blocks")
    prefixes = (spec.block_prefixes(*span) if span else []) + (spec.head_prefixes if head else [])
    for name in spec.box_files(prefixes):
        typer.echo(name)


TINY_ARCH_HELP = ("The family, as its Hugging Face model_type: llama, mistral, qwen2, qwen3, phi3, mixtral, gemma2, "
                  "gemma3_text or falcon (swarmnet/families.py).")


@model_app.command("tiny")
def model_tiny(out: Annotated[Path, typer.Argument(help="Directory to write.")],
               layers: Annotated[int, typer.Option(min=1, help="Number of decoder layers.")] = 4,
               arch: Annotated[str, typer.Option(help=TINY_ARCH_HELP)] = "llama",
               seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
               context: Annotated[int, typer.Option(min=16, help="Context length (max_position_embeddings).")] = 2048,
               shard_size: Annotated[str | None, typer.Option(
                   help="Cut the weights into shards of at most this size (e.g. 100KB), with an index.")] = None
               ) -> None:
    """Write a small random model with a tokenizer and its weights manifest (tests, benchmarks)."""
    from modelprep import write_tiny_model

    typer.echo(write_tiny_model(out, layers=layers, arch=arch, seed=seed, context=context, shard_size=shard_size,
                                manifest=True))


# ---- swarm processes ------------------------------------------------------------------------------------------
@app.command("dht")
def dht(host: HostOption = "127.0.0.1", port: PortOption = 0,
        identity: Annotated[Path | None, typer.Option(help="Key file; keeps the peer id across restarts.")] = None,
        announce_host: AnnounceHostOption = None,
        initial_peers: PeersOption = [],  # noqa: B006 - typer reads the default; nothing mutates it
        swarm_file: SwarmFileOption = None, relay: RelayOption = False) -> None:
    """Run a DHT bootstrap node; prints its full multiaddr on one stdout line when ready."""
    from servers.bootstrap import run_bootstrap_node

    network = network_options(host, port, identity, announce_host, relay=relay)  # a bad address fails first, in one line
    membership = server_membership("DHT node", host, swarm_file, identity)

    def on_ready(maddrs: list[str]) -> None:
        typer.echo(maddrs[0])
        sys.stdout.flush()

    run_bootstrap_node(initial_peers, network, on_ready, None if membership.is_open else membership)


def parse_blocks(value: str | None) -> tuple[int, int] | None:
    """'A:B' -> (A, B)."""
    if value is None:
        return None
    try:
        start, end = (int(part) for part in value.split(":"))
    except ValueError:
        raise typer.BadParameter("expected START:END, e.g. 0:15", param_hint="--blocks") from None
    if not 0 <= start < end:
        raise typer.BadParameter(f"empty or negative span {value}", param_hint="--blocks")
    return start, end


@app.command("serve")
@with_config_options(ServerConfig)
def serve(model: Annotated[str, typer.Argument(help=MODEL_HELP)],
          initial_peers: PeersOption,
          blocks: Annotated[str | None, typer.Option(help="Serve blocks START:END.")] = None,
          host: HostOption = "127.0.0.1", port: PortOption = 0, announce_host: AnnounceHostOption = None,
          identity: Annotated[Path | None, typer.Option(help="Key file; keeps the peer id.")] = None,
          swarm_file: SwarmFileOption = None, relay: RelayOption = False, use_relay: UseRelayOption = False,
          **tuning: Any) -> None:
    """Run a block server for a span of the model's blocks (each further option: servers/config.py)."""
    from servers.server import run_server

    if not initial_peers:
        raise typer.BadParameter("a block server needs at least one DHT multiaddr (run 'swarmbatch dht')",
                                 param_hint="--initial-peers")
    # a bad address fails before the model loads
    network = network_options(host, port, identity, announce_host, relay=relay, use_relay=use_relay)
    server_membership("server", host, swarm_file, identity)  # the warning, and one-line errors before loading
    config = ServerConfig(model_dir=str(resolve_model(model)), initial_peers=initial_peers, blocks=parse_blocks(blocks),
                          network=network, swarm_file=str(swarm_file) if swarm_file else None,
                          **config_values(ServerConfig, tuning))
    run_server(config, print_ready)


def print_ready(status: Any, maddrs: list[str]) -> None:
    """The ready line on stdout, flushed: launchers wait for it."""
    span = status.loaded_span()
    typer.echo(serving_line(span.start, span.end, status.model_id, status.peer_id, maddrs))
    sys.stdout.flush()


# ---- swarm client -----------------------------------------------------------------------------------------------
@swarm_app.command("status")
def swarm_status(model: Annotated[str, typer.Argument(help=MODEL_HELP)],
                 initial_peers: PeersOption, as_json: JsonOption = False, swarm_file: SwarmFileOption = None,
                 identity: MemberKeyOption = None) -> None:
    """Coverage map: which servers hold each block, their state, and which blocks are missing (with --swarm-file:
    only members count; others are marked 'not a member (ignored)'; --identity says whether that key is a member)."""
    from swarmclient.coverage import read_coverage, render_coverage

    report = read_coverage(resolve_model(model), initial_peers, client_access(swarm_file, identity, strict=False))
    typer.echo(json.dumps(report, indent=2) if as_json else render_coverage(report))


@app.command("generate")
def generate(model: Annotated[str, typer.Argument(help=MODEL_HELP)],
             prompts: Annotated[list[str], typer.Argument(help="One or more prompts.")],
             initial_peers: PeersOption,
             max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate per prompt.")] = 32,
             temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
             top_p: Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling mass.")] = 1.0,
             seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
             chat: Annotated[bool, typer.Option(help="Wrap each prompt in the model's chat template.")] = False,
             verify_fraction: Annotated[float, typer.Option(
                 envvar="SWARMBATCH_VERIFY_FRACTION", min=0.0, max=1.0,
                 help="Recompute this fraction of steps on a second server holding the same blocks and ban a server "
                      "whose outputs differ; 0 = off (the default here; jobs default to 0.02).")] = 0.0,
             push: Annotated[bool, typer.Option(
                 envvar="SWARMBATCH_PUSH",
                 help="Servers push each step's outputs straight to the next server (about (hops + 1) / 2 round trips "
                      "per token instead of hops); --no-push: the client relays every hop.")] = True,
             ring: Annotated[bool, typer.Option(
                 envvar="SWARMBATCH_RING",
                 help="A greedy generation asks the last server, where it holds the head (serve --ring), to guess each "
                      "next token and push its step to the first server: half a round trip less per token; "
                      "--no-ring: never.")] = True,
             micro_batches: Annotated[int, typer.Option(
                 min=1, help="Run the prompts as this many micro-batches at once, so that every server computes while "
                             "the others do (pipeline parallelism; rows grouped by length). 1 = one batch.")] = 1,
             as_json: JsonOption = False, swarm_file: SwarmFileOption = None, identity: MemberKeyOption = None) -> None:
    """One-off generation through the swarm."""
    from swarmclient.textgen import generate_texts
    from swarmclient.verification_policy import VerificationTally

    access = client_access(swarm_file, identity)
    began = time.perf_counter()
    checks = VerificationTally()
    outputs = generate_texts(resolve_model(model), prompts, initial_peers=initial_peers, chat=chat,
                             max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                             access=access, verify_fraction=verify_fraction, verification=checks, push=push,
                             micro_batches=micro_batches, ring=ring)
    counts = checks.snapshot()
    if as_json:
        typer.echo(json.dumps({"outputs": outputs, "verification": {
            "steps_verified": counts.verified, "mismatches": counts.mismatches, "steps_unverified": counts.unverified}}))
        return
    for item in outputs:
        typer.echo(f"--- {item['prompt']!r}\n{item['text']}")
    tokens = sum(len(item["token_ids"]) for item in outputs)
    typer.echo(f"{tokens} tokens in {time.perf_counter() - began:.1f} s", err=True)
    if verify_fraction > 0:
        typer.echo(f"{counts.verified} steps verified on a second server, {counts.mismatches} mismatches, "
                   f"{counts.unverified} sampled steps without a second server", err=True)


@app.command("demo")
def demo() -> None:
    """The main job, embedded: a local DHT and two block servers, SmolLM2 generating summaries."""
    from launch.demo import run_demo
    from launch.processes import exit_on_sigterm

    exit_on_sigterm()
    run_demo(echo=typer.echo)


# ---- members of a private swarm -----------------------------------------------------------------------------------------
SwarmFileArgument = Annotated[Path, typer.Argument(help="The swarm file (JSON: member peer ids, names and roles).")]


class MemberRole(StrEnum):
    """What a member's key may do (swarmnet.membership: SERVER, CLIENT, ANY)."""

    server = "server"
    client = "client"
    any = "any"


@swarm_app.command("init")
def swarm_init(path: SwarmFileArgument) -> None:
    """Write a new swarm file with no members (refuses to overwrite one)."""
    from swarmnet.membership import SwarmFile

    SwarmFile.create(path)
    typer.echo(path)


@swarm_app.command("new-key")
def swarm_new_key(path: Annotated[Path, typer.Argument(help="The key file to create (refuses to overwrite one).")]
                  ) -> None:
    """Create a key file (for --identity) and print its peer id, which add-member takes."""
    from swarmnet.identity import Identity

    typer.echo(Identity.create(path).peer_id)


def member_peer_id(key_or_peer: str) -> tuple[str, str]:
    """A key file's or a peer id's (peer id, default name)."""
    from swarmnet.identity import Identity
    from swarmnet.membership import check_peer_id

    if Path(key_or_peer).is_file():
        return Identity.load(key_or_peer).peer_id, Path(key_or_peer).stem
    return check_peer_id(key_or_peer), key_or_peer[-8:]


@swarm_app.command("add-member")
def swarm_add_member(swarm_file: SwarmFileArgument,
                     key_or_peer: Annotated[str, typer.Argument(help="A key file, or the peer id new-key printed.")],
                     name: Annotated[str | None, typer.Option(help="A name to know it by (default: the key file's "
                                                                   "name, or the peer id's end).")] = None,
                     role: Annotated[MemberRole, typer.Option(
                         help="server: a block server's or DHT node's key (announced, routed through, pushed to); "
                              "client: a worker's or generate's key (opens sessions, never routed through); any: "
                              "both (what members of a file written before roles have).")] = MemberRole.any) -> None:
    """Add a member (a server's, DHT node's or client's key) to the swarm file, or change its name or role; copy the
    file to every machine."""
    from swarmnet.membership import SwarmFile

    swarm = SwarmFile.load(swarm_file)
    peer_id, default_name = member_peer_id(key_or_peer)
    swarm.add(peer_id, name or default_name, role.value)
    swarm.save()
    typer.echo(f"added {peer_id} ({swarm.members[peer_id]}, {role.value}): {len(swarm.members)} members in "
               f"{swarm_file}; copy it to every machine (running processes re-read it within seconds)")


@swarm_app.command("remove-member")
def swarm_remove_member(swarm_file: SwarmFileArgument,
                        member: Annotated[str, typer.Argument(help="A peer id, a member's name, or a key file.")]
                        ) -> None:
    """Remove a member from the swarm file; servers given the new file refuse it within seconds."""
    from swarmnet.membership import SwarmFile

    swarm = SwarmFile.load(swarm_file)
    peer_id, name = swarm.remove(member_peer_id(member)[0] if Path(member).is_file() else member)
    swarm.save()
    typer.echo(f"removed {peer_id} ({name}): {len(swarm.members)} members left in {swarm_file}; copy it to every "
               "machine")


@swarm_app.command("members")
def swarm_members(swarm_file: SwarmFileArgument, as_json: JsonOption = False) -> None:
    """List the members of a swarm file: peer id, name and role."""
    from swarmnet.membership import SwarmFile

    swarm = SwarmFile.load(swarm_file)
    if as_json:
        typer.echo(json.dumps([{"peer_id": peer, "name": name, "role": swarm.role_of(peer)}
                               for peer, name in swarm.members.items()]))
        return
    if not swarm.members:
        typer.echo(f"no members yet: add them with 'swarmbatch swarm add-member {swarm_file} KEYFILE|PEERID "
                   "--role server|client'")
    for peer, name in swarm.members.items():
        typer.echo(f"{peer}  {name}  {swarm.role_of(peer)}")
