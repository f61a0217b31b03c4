"""`swarmbatch swarm status`: the coverage map of a model's blocks, read from the DHT."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from swarmclient.routing import missing_ranges
from swarmclient.swarm import Swarm
from swarmnet.data_structures import PROTOCOL_VERSION, RemoteSpanInfo, ServerInfo, ServerState
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
         "version": info.version, "compatible": info.version == PROTOCOL_VERSION, "member": membership.serves(peer)}
        for peer, info in sorted(servers.items())]} for index, servers in enumerate(block_infos)]
    members = [s for s in online_spans(block_infos) if membership.serves(s.peer_id)]
    missing = missing_ranges(members, 0, len(block_infos))
    return {"model_id": model_id, "num_blocks": len(block_infos), "blocks": blocks,
            "missing": [list(r) for r in missing], "complete": not missing,
            "bottleneck": bottleneck(members, len(block_infos)), "servers": server_histories(block_infos, membership)}


def bottleneck(members: list[RemoteSpanInfo], num_blocks: int) -> dict[str, Any]:
    """The weakest block (the first one) and its summed throughput over the ONLINE members that hold it."""
    totals = [sum(s.info.throughput for s in members if s.start <= index < s.end) for index in range(num_blocks)]
    weakest = min(range(num_blocks), key=lambda index: totals[index], default=0)
    return {"block": weakest, "throughput": round(totals[weakest], 1) if totals else 0.0}


def server_histories(block_infos: list[BlockServers], membership: Membership) -> list[dict[str, Any]]:
    """One entry per server: its span now, whether it may move, and its last moves (what its record carries)."""
    records: dict[str, ServerInfo] = {}
    for index, servers in enumerate(block_infos):
        for peer, info in servers.items():  # a server that moved left OFFLINE records under the blocks it left
            if peer not in records or (records[peer].state == ServerState.OFFLINE and info.start <= index < info.end):
                records[peer] = info
    return [{"peer_id": peer, "state": info.state.value, "start": info.start, "end": info.end,
             "throughput": round(info.throughput, 1), "rebalances": info.rebalances, "member": membership.serves(peer),
             "moves": [move.model_dump(mode="json") for move in info.moves]} for peer, info in sorted(records.items())]


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


def _history_lines(report: dict[str, Any]) -> list[str]:
    """The bottleneck, then one line per server: its span and its moves, oldest first."""
    weakest = report.get("bottleneck")
    lines = [] if weakest is None else [f"Bottleneck: {weakest['throughput']:.0f} steps/s at block {weakest['block']}"]
    for server in report.get("servers", []):
        kind = "unpinned" if server["rebalances"] else "pinned"
        moves = "; ".join(f"{m['from_start']}:{m['from_end']} -> {m['start']}:{m['end']} at "
                          f"{time.strftime('%H:%M:%S', time.localtime(m['at']))} ({m['reason']})" for m in server["moves"])
        lines.append(f"  {server['peer_id'][-6:]}  {server['start']}:{server['end']} {server['state']}, {kind}"
                     + (f", moved {moves}" if moves else ""))
    return lines


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
    lines += _history_lines(report)
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
