"""Benchmark: what the member check adds to opening a session — a private swarm against an open one, same run.

Two swarms of one server each (all blocks, one torch thread): one open, one private (a swarm file; the client holds
a member key). Each rep opens a session on both, in alternating order, and times the open: the route, the stream,
and the opening step (a 1-token prefill, the message whose credential a private server checks first); then it
closes the session, untimed. It prints the median open of each and the median of the paired differences. The
first session of a client process costs its server one signature check; later ones find the credential cached.
It also times the parts in this process: issuing a credential (an RSA signature, once a day per client process),
a full check (parse, then an RSA verification) and a cached one.

usage: python bench/membership.py [--model tiny|smollm2|PATH] [--reps 200]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from jobrun import bench_setup  # noqa: E402  (bench/ is the script's folder, first on sys.path)
from timing import median_call_seconds  # noqa: E402

from launch.local_swarm import LocalSwarm  # noqa: E402
from servers.access import MemberGate  # noqa: E402
from swarmclient.session import InferenceSession  # noqa: E402
from swarmclient.swarm import Swarm  # noqa: E402
from swarmnet.identity import Identity  # noqa: E402
from swarmnet.membership import MemberCredential, Membership  # noqa: E402
from swarmnet.model_spec import ModelSpec  # noqa: E402

CALLER = "12D3KooWCxbSVdL8unKt3Y4pzF1KX9GJLuq7DiGtDJwP5HhSaFRP"


def time_open(swarm: Swarm, hidden_size: int) -> float:
    """Seconds from nothing to the answer of a session's opening step; the session is closed afterwards."""
    session = InferenceSession(swarm, batch_size=1, max_length=8)
    began = time.perf_counter()
    swarm.loop.run(session.open())
    session.step(torch.zeros(1, 1, hidden_size), torch.ones(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    seconds = time.perf_counter() - began
    swarm.loop.run(session.close())
    return seconds


def in_process(swarm_file: Path, member: Identity) -> None:
    membership = Membership.from_file(swarm_file)
    expires = int(time.time()) + 86400
    blob = MemberCredential.issue(member, CALLER, expires).to_bytes()
    warm = MemberGate(membership)
    warm.check(CALLER, {"credential": blob})
    issue = 1e6 * median_call_seconds(lambda: MemberCredential.issue(member, CALLER, expires), reps=50)
    full = 1e6 * median_call_seconds(lambda: MemberGate(membership).check(CALLER, {"credential": blob}), reps=200)
    cached = 1e6 * median_call_seconds(lambda: warm.check(CALLER, {"credential": blob}), reps=2000)
    print(f"in process ({len(blob)}-byte credential): issue {issue:.0f} µs, full check {full:.0f} µs, "
          f"cached check {cached:.1f} µs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny (a 6-layer random model: compute stays out of the way), "
                                                        "smollm2 or a model dir")
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    home, model_dir = bench_setup(args.model)
    spec = ModelSpec.open(model_dir)
    blocks = [(0, spec.num_blocks)]
    with LocalSwarm(model_dir, blocks, log_dir=home / "open") as opened, \
            LocalSwarm(model_dir, blocks, log_dir=home / "private", private=True) as private:
        assert private.swarm_file is not None and private.client_key is not None
        in_process(private.swarm_file, Identity.load(private.client_key))
        clients = {"open": Swarm.connect(opened.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks),
                   "private": Swarm.connect(private.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks,
                                            access=private.access())}
        try:
            first = {name: time_open(client, spec.hidden_size) for name, client in clients.items()}
            times: dict[str, list[float]] = {"open": [], "private": []}
            for rep in range(args.reps):
                for name in (("open", "private") if rep % 2 == 0 else ("private", "open")):
                    times[name].append(time_open(clients[name], spec.hidden_size))
        finally:
            for client in clients.values():
                client.close()
    diffs = [p - o for p, o in zip(times["private"], times["open"], strict=True)]
    quartiles = statistics.quantiles(diffs, n=4)
    print(f"first session of a client: open {first['open'] * 1e3:.2f} ms, private {first['private'] * 1e3:.2f} ms")
    print(f"session open + first step, median of {args.reps}: open {statistics.median(times['open']) * 1e3:.3f} ms, "
          f"private {statistics.median(times['private']) * 1e3:.3f} ms; paired difference median "
          f"{statistics.median(diffs) * 1e3:+.3f} ms [p25 {quartiles[0] * 1e3:+.3f}, p75 {quartiles[2] * 1e3:+.3f}]")


if __name__ == "__main__":
    main()
