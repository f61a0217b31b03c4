"""`swarmbatch swarm status`: the coverage map of a model's blocks, read from the DHT."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from swarmclient.data_structures import PROTOCOL_VERSION, ServerState
from swarmclient.discovery import BlockServers, online_spans
from swarmclient.model_spec import ModelSpec
from swarmclient.routing import missing_ranges
from swarmclient.swarm import Swarm


def coverage_report(model_id: str, block_infos: list[BlockServers]) -> dict[str, Any]:
    """A JSON-ready map: per block its servers, and the block ranges no ONLINE server holds."""
    blocks = [{"index": index, "servers": [
        {"peer_id": peer, "state": info.state.value, "start": info.start, "end": info.end,
         "throughput": round(info.throughput, 1), "cache_tokens_left": info.cache_tokens_left,
         "version": info.version, "compatible": info.version == PROTOCOL_VERSION}
        for peer, info in sorted(servers.items())]} for index, servers in enumerate(block_infos)]
    missing = missing_ranges(online_spans(block_infos), 0, len(block_infos))
    return {"model_id": model_id, "num_blocks": len(block_infos), "blocks": blocks,
            "missing": [list(r) for r in missing], "complete": not missing}


def read_coverage(model_dir: Path, initial_peers: list[str]) -> dict[str, Any]:
    """Join the DHT, read every block's announcements, and build the coverage report."""
    spec = ModelSpec.open(model_dir)
    swarm = Swarm.connect(initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks)
    try:
        infos = swarm.loop.run(swarm.block_infos(refresh=True))
    finally:
        swarm.close()
    return coverage_report(spec.model_id, infos)


def _old_servers(report: dict[str, Any]) -> bool:
    return any(not s["compatible"] for block in report["blocks"] for s in block["servers"])


def render_coverage(report: dict[str, Any]) -> str:
    """The report as a table: one row per block; servers as peer-suffix(state)."""
    lines = [f"model {report['model_id']}: {report['num_blocks']} blocks"]
    for block in report["blocks"]:
        servers = ", ".join(f"{s['peer_id'][-6:]}({s['state']}, {s['throughput']:.0f}/s"
                            f"{'' if s['compatible'] else ', protocol ' + s['version'] + ': not used'})"
                            for s in block["servers"])
        online = any(s["state"] == ServerState.ONLINE.value and s["compatible"] for s in block["servers"])
        lines.append(f"{block['index']:>5}  {'ok ' if online else 'MISSING'}  {servers or '-'}")
    if report["missing"]:
        ranges = ", ".join(f"{a}:{b}" for a, b in report["missing"])
        upgrade = f" (or upgrade the servers marked not used to {PROTOCOL_VERSION})" if _old_servers(report) else ""
        lines.append(f"Missing blocks {ranges}: start 'swarmbatch serve MODEL --blocks A:B' for them{upgrade}.")
    else:
        lines.append("All blocks are served.")
    return "\n".join(lines)
