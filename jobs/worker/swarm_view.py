"""The swarm snapshot a worker publishes for the API's swarm page: the coverage map it reads from the DHT (the
same as `swarmbatch swarm status`), with what this worker measured of each server, written to the store
(jobs.snapshots) at most every `swarm_snapshot_seconds` across all workers. A snapshot never stops a batch."""
from __future__ import annotations

import logging
import threading
from typing import Any

from jobs import snapshots
from jobs.runtime import Runtime
from swarmclient.coverage import coverage_report
from swarmclient.swarm import Swarm
from swarmnet.discovery import BlockServers

logger = logging.getLogger(__name__)
_publishing: dict[str, threading.Thread] = {}  # model -> the thread publishing its snapshot now


def swarm_report(swarm: Swarm, infos: list[BlockServers]) -> dict[str, Any]:
    """The coverage report of `infos`, each server also with this worker's view of it (the round trip it measured, in
    ms; whether it bans it now) and its announced dtype, quantization and batch size."""
    report = coverage_report(swarm.model_id, infos, swarm.access.membership)
    for block, servers in zip(report["blocks"], infos, strict=True):
        for server in block["servers"]:
            peer, info = server["peer_id"], servers[server["peer_id"]]
            rtt = swarm.rtts.get(peer)
            server.update(rtt_ms=None if rtt is None else round(rtt * 1000, 1), banned=swarm.bans.is_banned(peer),
                          dtype=info.dtype, quant=info.quant, max_batch_size=info.max_batch_size)
    return report


def publish_if_due(runtime: Runtime, model: str) -> bool:
    """Publish what this worker sees of `model`'s swarm, unless a worker did within the interval; True if it did."""
    try:
        with runtime.session() as session:
            if not snapshots.snapshot_due(session=session, model=model,
                                          interval=runtime.settings.swarm_snapshot_seconds):
                return False
        swarm = runtime.swarm_model(model).swarm
        report = swarm_report(swarm, swarm.loop.run(swarm.block_infos(), timeout=30))
        with runtime.session() as session:
            snapshots.publish_snapshot(session=session, model=model, worker=runtime.worker_name, report=report)
            session.commit()
        return True
    except Exception as e:  # the swarm page may be stale; the batch must go on
        logger.info("No swarm snapshot of %s this time: %s", model, e)
        return False


def publish_in_background(runtime: Runtime, model: str) -> None:
    """`publish_if_due` on a thread of its own, one per model at a time: a lease renewal never waits for the DHT or
    the store's snapshot row (under a short lease, that wait let leases lapse)."""
    running = _publishing.get(model)
    if running is not None and running.is_alive():
        return
    _publishing[model] = thread = threading.Thread(target=publish_if_due, args=(runtime, model),
                                                   name="swarm-snapshot", daemon=True)
    thread.start()
