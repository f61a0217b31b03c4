"""`swarmbatch swarm status`: the coverage map of a model's blocks, read from the DHT."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from swarmclient.routing import missing_ranges
from swarmclient.swarm import Swarm
from swarmnet.data_structures import PROTOCOL_VERSION, ServerState
from swarmnet.discovery import BlockServers, online_spans
from swarmnet.membership import Membership, SwarmAccess
from swarmnet.model_spec import ModelSpec

NOT_A_MEMBER = "not a member (ignored)"


def coverage_report(model_id: str, block_infos: list[BlockServers], membership: Membership | None = None
                    ) -> dict[str, Any]:
    """A JSON-ready map: per block its servers, and the block ranges no ONLINE member holds (non-members are listed,
    marked `"member": false`, and cover nothing: clients never route through them)."""
    membership = membership or Membership.open()
    blocks = [{"index": index, "servers": [
        {"peer_id": peer, "state": info.state.value, "start": info.start, "end": info.end,
         "throughput": round(info.throughput, 1), "cache_tokens_left": info.cache_tokens_left,
         "version": info.version, "compatible": info.version == PROTOCOL_VERSION, "member": membership.allows(peer)}
        for peer, info in sorted(servers.items())]} for index, servers in enumerate(block_infos)]
    members = [s for s in online_spans(block_infos) if membership.allows(s.peer_id)]
    missing = missing_ranges(members, 0, len(block_infos))
    return {"model_id": model_id, "num_blocks": len(block_infos), "blocks": blocks,
            "missing": [list(r) for r in missing], "complete": not missing}


def read_coverage(model_dir: Path, initial_peers: list[str], access: SwarmAccess | None = None) -> dict[str, Any]:
    """Join the DHT, read every block's announcements, and build the coverage report (with our access, if private)."""
    spec = ModelSpec.open(model_dir)
    access = access or SwarmAccess.open()
    swarm = Swarm.connect(initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks, access=access)
    try:
        infos = swarm.loop.run(swarm.block_infos(refresh=True))
    finally:
        swarm.close()
    return {**coverage_report(spec.model_id, infos, access.membership), "access": access.describe()}


def _old_servers(report: dict[str, Any]) -> bool:
    return any(not s["compatible"] for block in report["blocks"] for s in block["servers"])


def _server(s: dict[str, Any]) -> str:
    notes = ("" if s["compatible"] else f", protocol {s['version']}: not used") + \
        ("" if s.get("member", True) else f", {NOT_A_MEMBER}")
    return f"{s['peer_id'][-6:]}({s['state']}, {s['throughput']:.0f}/s{notes})"


def render_coverage(report: dict[str, Any]) -> str:
    """The report as a table: one row per block; servers as peer-suffix(state)."""
    lines = [f"model {report['model_id']}: {report['num_blocks']} blocks"]
    access = report.get("access")
    if access and access["private"]:
        key = access["key"]
        lines.append(f"private swarm {access['swarm_file']}" + ("" if key is None else
                     f"; this key {key['peer_id']} is {'a member' if key['member'] else 'NOT a member'}"))
    for block in report["blocks"]:
        servers = ", ".join(_server(s) for s in block["servers"])
        online = any(s["state"] == ServerState.ONLINE.value and s["compatible"] and s.get("member", True)
                     for s in block["servers"])
        lines.append(f"{block['index']:>5}  {'ok ' if online else 'MISSING'}  {servers or 'no server'}")
    lines.append(_verdict(report))
    return "\n".join(lines)


def _verdict(report: dict[str, Any]) -> str:
    """The last line: every block served, or which have no server, what that means and what to do."""
    if not report["missing"]:
        return "All blocks are served."
    ranges = ", ".join(f"{a}:{b}" for a, b in report["missing"])
    count = sum(b - a for a, b in report["missing"])
    upgrade = f" (or upgrade the servers marked not used to {PROTOCOL_VERSION})" if _old_servers(report) else ""
    return (f"Missing blocks {ranges}: {count} of {report['num_blocks']} blocks have no server online, so nothing "
            f"can be generated until one holds them: start 'swarmbatch serve MODEL --blocks A:B' for them{upgrade}.")
