"""Ready lines: what a long-running command prints on stdout once it is up; launchers and tests wait for them.

`swarmbatch serve` (commands/swarm.py) prints them. No dependencies, so tests read it without typer or the CLI.
"""
from __future__ import annotations

# a block server is ONLINE: 'Serving blocks A:B of MODEL_ID as PEER_ID at MADDR ...'
SERVING_BLOCKS = "Serving blocks"


def serving_line(start: int, end: int, model_id: str, peer_id: str, maddrs: list[str]) -> str:
    """The line a block server prints once it is ONLINE (its peer id is the word after 'as')."""
    return f"{SERVING_BLOCKS} {start}:{end} of {model_id} as {peer_id} at {' '.join(maddrs)}"
