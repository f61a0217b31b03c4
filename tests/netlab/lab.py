"""`NetLab`: N network namespaces joined by a bridge, each with a one-way delay on what it receives, plus extra delay
on chosen links.

Layout: a hub namespace holds the bridge; node i is a namespace with one veth (`eth0`, 10.250.0.(i+1)/24) plugged
into it, and `lo`. No namespace has a default route, and nothing is plugged into the host's own namespace, so a
process in a node reaches only the other nodes. A node with a delay D sends every packet arriving on `eth0` to an
NFQUEUE (an iptables INPUT rule in the node), where `delay.py` holds it D ms: the round trip between nodes a and b
is then D_a + D_b (delay on input, not output: held at output, bulk TCP collapses; FACTS.md). Loopback inside a
node is not delayed. A link (a, b) given an extra delay E gets its own queue in both nodes, fed by a rule matching the
other end's address ahead of the node's own: packets from a to b wait D_b + E, from b to a D_a + E, so that pair is
D_a + D_b + 2E apart while every other pair keeps its sum (a "WAN" between two groups of nodes).

Everything a lab starts runs under `ip netns exec` (which execs the command: the PID is the command's) in its own
process group, and is stopped by PID; leaving the lab stops the processes, then deletes the namespaces (with them
their veths, bridge and iptables rules), also after a failure halfway through building it. Namespaces are named
`sbw<pid><letter>-...`; a lab deletes the ones left behind by processes that no longer exist.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from launch.errors import ProcessNotReady
from launch.processes import ManagedProcess

SUBNET = "10.250.0"  # inside the lab's own namespaces only: it collides with nothing outside them
# A range libp2p counts as public (not RFC 1918, CGNAT, documentation or benchmarking space), for labs where a
# relay's address must look public: a node behind NAT announces circuit addresses only through public relay
# addresses. Only the lab's namespaces, which have no route out, ever hold it.
PUBLIC_SUBNET = "11.250.0"
NAT_SUBNET = "192.168.{}"  # the private network behind router node i (NetLab.behind_nat)
QUEUE = 1  # a node's own NFQUEUE (per namespace); QUEUE + 1 + i: the queue of a delayed link from node i
DELAY_PROGRAM = Path(__file__).with_name("delay.py")
_labs = itertools.count()


class LabError(RuntimeError):
    """Building the lab failed (a command refused); the message names the command and its error."""


def unavailable() -> str | None:
    """Why this process cannot build a lab (one line), or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, as CI does)"
    missing = [tool for tool in ("ip", "iptables", "ping") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install iproute2 iptables iputils-ping; .ci/run does)"
    return None


@dataclass(frozen=True)
class Node:
    """One machine of the lab: its namespace, address and input delay."""

    index: int
    namespace: str
    ip: str
    delay_ms: float


def _run(*args: str) -> str:
    """Run a setup command; raises LabError with its stderr."""
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise LabError(f"{' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def remove_stale_namespaces() -> None:
    """Delete lab namespaces whose creating process is gone (a lab killed before it could clean up)."""
    for line in _run("ip", "netns", "list").splitlines():
        match = re.match(r"(sbw(\d+)[a-z]+-\S+)", line)
        if match and not os.path.exists(f"/proc/{match.group(2)}"):
            subprocess.run(["ip", "netns", "del", match.group(1)], capture_output=True)


class NetLab:
    """N network namespaces on a private bridge; a context manager that tears everything down.

    delay_ms: each node's one-way input delay (one number for all, or one per node).
    link_delay_ms: {(a, b): E}: extra one-way delay, each way, between nodes a and b (by index).
    """

    def __init__(self, nodes: int, *, delay_ms: float | Sequence[float] = 0.0,
                 link_delay_ms: Mapping[tuple[int, int], float] | None = None, log_dir: Path,
                 subnet: str = SUBNET) -> None:
        delays = [float(delay_ms)] * nodes if isinstance(delay_ms, int | float) else [float(d) for d in delay_ms]
        if len(delays) != nodes or not 1 <= nodes <= 200:
            raise ValueError(f"give 1..200 nodes and one delay per node, got {nodes} and {delays}")
        self.prefix = f"sbw{os.getpid()}{chr(ord('a') + next(_labs) % 26)}"
        self.hub = f"{self.prefix}-hub"
        self.subnet = subnet  # the nodes' /24 (PUBLIC_SUBNET: libp2p treats the addresses as public ones)
        self.nodes = [Node(i, f"{self.prefix}-n{i}", f"{subnet}.{i + 1}", d) for i, d in enumerate(delays)]
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.processes: list[ManagedProcess] = []
        self._namespaces: list[str] = []
        self.delays = delays  # each node's one-way input delay now (`set_delay`)
        self.link_delays: dict[tuple[int, int], float] = {}  # (receiver, sender) -> extra one-way ms
        for (a, b), extra in (link_delay_ms or {}).items():
            if a == b or not (0 <= a < nodes and 0 <= b < nodes) or extra <= 0:
                raise ValueError(f"a link delay joins two different nodes by index, with a positive delay: {(a, b)}")
            self.link_delays[(a, b)] = self.link_delays[(b, a)] = float(extra)
        self._delayers: dict[tuple[int, int | None], ManagedProcess] = {}  # (receiver, sender or None: all others)

    def __enter__(self) -> NetLab:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- building -------------------------------------------------------------------------------------------
    def build(self) -> None:
        """Make the hub and the nodes, then start each delayed node's delay program."""
        remove_stale_namespaces()
        self._add_namespace(self.hub)
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for node in self.nodes:
            self._add_node(node)
        for node in self.nodes:
            self._count_and_queue(node)
            self.set_delay(node, node.delay_ms)

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _add_node(self, node: Node) -> None:
        self._add_namespace(node.namespace)
        port = f"v{node.index}"
        _run("ip", "-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", node.namespace)
        _run("ip", "-n", self.hub, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", node.namespace, "addr", "add", f"{node.ip}/24", "dev", "eth0")
        _run("ip", "-n", node.namespace, "link", "set", "eth0", "up")

    def _count_and_queue(self, node: Node) -> None:
        """In the node's INPUT: one counting rule per other node (bytes from it: `traffic`), then one NFQUEUE rule
        per delayed link (queue QUEUE + 1 + the sender's index), then the NFQUEUE rule that hands the rest of what
        eth0 receives to the node's delay program (--queue-bypass: passed on at once while none reads)."""
        iptables = ("ip", "netns", "exec", node.namespace, "iptables", "-A", "INPUT", "-i", "eth0")
        for other in self.nodes:
            if other is not node:
                _run(*iptables, "-s", other.ip)
        for other in self.nodes:
            if (node.index, other.index) in self.link_delays:
                _run(*iptables, "-s", other.ip, "-j", "NFQUEUE", "--queue-num", str(QUEUE + 1 + other.index),
                     "--queue-bypass")
        _run(*iptables, "-j", "NFQUEUE", "--queue-num", str(QUEUE), "--queue-bypass")

    def set_delay(self, node: Node, delay_ms: float, *, queued: bool = False) -> None:
        """Give a node another one-way input delay (0: none), its delayed links' extra kept on top; packets pass
        undelayed during the swap. `queued`: packets pass through a delay program even at 0 ms (a benchmark's
        control: the emulation's own CPU cost without the latency)."""
        self.delays[node.index] = delay_ms
        senders = [None, *(sender for receiver, sender in self.link_delays if receiver == node.index)]
        for sender in senders:
            old = self._delayers.pop((node.index, sender), None)
            if old is not None:
                old.terminate(timeout=5)
                self.processes.remove(old)
            total = delay_ms + (0.0 if sender is None else self.link_delays[(node.index, sender)])
            if total > 0 or queued:
                queue = QUEUE if sender is None else QUEUE + 1 + sender
                self._delayers[(node.index, sender)] = self._delay(node, total, queue)

    def delay_cpu_seconds(self) -> float:
        """CPU seconds the running delay programs have used so far (user + system; what the emulation takes from
        the machine's cores, which separate machines would not pay)."""
        ticks = 0
        for program in self._delayers.values():
            try:
                fields = Path(f"/proc/{program.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        return ticks / os.sysconf("SC_CLK_TCK")

    def traffic(self) -> dict[tuple[int, int], int]:
        """Bytes received so far, by (sending node, receiving node), IP headers included."""
        counts = {}
        for node in self.nodes:
            listing = self.exec(node, ["iptables", "-L", "INPUT", "-v", "-x", "-n"], timeout=30).stdout
            for line in listing.splitlines():
                fields = line.split()  # pkts bytes [target] prot opt in out source destination
                sources = [f for f in fields[2:] if f.startswith(self.subnet + ".")]
                if fields and fields[0].isdigit() and len(sources) == 1 and "NFQUEUE" not in fields:
                    counts[(int(sources[0].rsplit(".", 1)[1]) - 1, node.index)] = int(fields[1])
        return counts

    def _delay(self, node: Node, delay_ms: float, queue: int) -> ManagedProcess:
        """Start a delay program in the node (it reads the NFQUEUE `queue` that one of the node's INPUT rules feeds)."""
        program = self.run(node, [sys.executable, str(DELAY_PROGRAM), "--queue", str(queue),
                                  "--delay-ms", str(delay_ms)], name=f"delay{node.index}-q{queue}-{delay_ms:g}ms")
        try:
            program.wait_for_line("ready", timeout=30)
        except ProcessNotReady as e:  # e.g. "nfqueue unavailable: ..." in its log
            raise LabError(f"the delay program did not start: {program.log_path.read_text()[-300:].strip()}") from e
        return program

    def behind_nat(self, router: Node, *, delay_ms: float | None = None) -> Node:
        """A machine behind NAT: a namespace on a private network behind `router` (192.168.(100+i).0/24), whose
        packets leave masqueraded as the router's address (iptables MASQUERADE) and whose router forwards nothing
        inbound that it did not open (no port forwarding): no other node can dial it. Its input is delayed like
        the router's (or `delay_ms`); the router adds no delay to what it forwards (INPUT only sees its own)."""
        inside = Node(100 + router.index, f"{self.prefix}-nat{router.index}", NAT_SUBNET.format(100 + router.index) + ".2",
                      router.delay_ms if delay_ms is None else delay_ms)
        gateway, lan = NAT_SUBNET.format(100 + router.index) + ".1", NAT_SUBNET.format(100 + router.index) + ".0/24"
        self._add_namespace(inside.namespace)
        _run("ip", "-n", router.namespace, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns",
             inside.namespace)
        _run("ip", "-n", router.namespace, "addr", "add", f"{gateway}/24", "dev", "lan0")
        _run("ip", "-n", router.namespace, "link", "set", "lan0", "up")
        _run("ip", "-n", inside.namespace, "addr", "add", f"{inside.ip}/24", "dev", "eth0")
        _run("ip", "-n", inside.namespace, "link", "set", "eth0", "up")
        _run("ip", "-n", inside.namespace, "route", "add", "default", "via", gateway)
        in_router = ("ip", "netns", "exec", router.namespace)
        _run(*in_router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _run(*in_router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-s", lan, "-o", "eth0", "-j", "MASQUERADE")
        _run(*in_router, "iptables", "-A", "FORWARD", "-i", "eth0", "-o", "lan0", "-m", "conntrack", "--ctstate",
             "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _run(*in_router, "iptables", "-A", "FORWARD", "-i", "eth0", "-o", "lan0", "-j", "DROP")
        if inside.delay_ms > 0:
            _run("ip", "netns", "exec", inside.namespace, "iptables", "-A", "INPUT", "-i", "eth0", "-j", "NFQUEUE",
                 "--queue-num", str(QUEUE), "--queue-bypass")
            self._delay(inside, inside.delay_ms, QUEUE)
        return inside

    # ---- using ----------------------------------------------------------------------------------------------
    def run(self, node: Node, args: Sequence[str], *, name: str, env: Mapping[str, str] | None = None
            ) -> ManagedProcess:
        """Start a process inside a node; the lab stops it on exit."""
        process = ManagedProcess(["ip", "netns", "exec", node.namespace, *args], name=name, log_dir=self.log_dir,
                                 env=dict(env or {}))
        self.processes.append(process)
        return process

    def exec(self, node: Node, args: Sequence[str], *, timeout: float = 600, env: Mapping[str, str] | None = None,
             input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a command inside a node to its end (`input` on its stdin); its output is captured (a failure is the
        caller's to check)."""
        return subprocess.run(["ip", "netns", "exec", node.namespace, *args], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **(env or {})}, input=input)

    def rtt_ms(self, source: Node, target: Node, *, count: int = 5) -> float:
        """The median round trip from source to target, by `ping -U` (user-to-user: it sees the input delay)."""
        done = self.exec(source, ["ping", "-U", "-n", "-c", str(count), "-i", "0.2", target.ip], timeout=60)
        times = sorted(float(t) for t in re.findall(r"time=([\d.]+) ms", done.stdout))
        if not times:
            raise LabError(f"ping {source.ip} -> {target.ip} got no answer: {done.stdout[-300:]} {done.stderr[-300:]}")
        return times[len(times) // 2]

    def close(self) -> None:
        """Stop every process the lab started (by PID), then delete its namespaces."""
        for process in reversed(self.processes):
            process.terminate(timeout=10)
        self.processes.clear()
        for name in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._namespaces.clear()


# ---- a swarm in the lab ---------------------------------------------------------------------------------------------
def start_dht(lab: NetLab, node: Node) -> list[str]:
    """Start a DHT bootstrap node on `node`; returns the initial peers to give everyone else."""
    from launch.processes import cli_command

    process = lab.run(node, cli_command("dht", "--host", node.ip), name=f"dht-n{node.index}")
    return [process.wait_for_line("/", timeout=60)]


def start_servers(lab: NetLab, model_dir: Path, initial_peers: Sequence[str],
                  specs: Sequence[tuple[Node, int, int, Sequence[str]]], *, ready_timeout: float = 180.0
                  ) -> list[ManagedProcess]:
    """Start block servers, each (node, start, end, extra args), on their nodes at once; wait until all serve."""
    from launch.processes import cli_command
    from launch.ready import SERVING_BLOCKS

    started = [lab.run(node, cli_command("serve", str(model_dir), "--blocks", f"{start}:{end}", "--host", node.ip,
                                         "--num-threads", "1", *extra, "--initial-peers", *initial_peers),
                       name=f"server-n{node.index}-{start}-{end}", env={"OMP_NUM_THREADS": "1"})
               for node, start, end, extra in specs]
    for server in started:
        server.wait_for_line(SERVING_BLOCKS, timeout=ready_timeout)
    return started
