"""The machine a server announces (`ServerInfo.machine`): servers sharing one machine's compute announce the same name,
so clients spread their sessions over machines, not over server processes (swarmclient/routing.py, `machine_loads`).

By default it is a digest of the running kernel's boot id: the same for every process and container of one host,
another on another host or after a reboot, and nothing a peer can tell the host from. `--machine NAME` names it
instead: virtual machines sharing one host's cores may name it alike, and a test's servers on one host may play
several machines.
"""
from __future__ import annotations

import hashlib
import socket
import uuid
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")  # the kernel's, so shared by containers of one host


def this_machine() -> str:
    """This host's name for routing: 16 hex digits of the boot id's digest (the host name and MAC where there is no
    boot id)."""
    try:
        seed = BOOT_ID.read_text().strip()
    except OSError:
        seed = ""
    if not seed:
        seed = f"{socket.gethostname()}/{uuid.getnode()}"
    return hashlib.sha256(b"swarmbatch machine " + seed.encode()).hexdigest()[:16]
