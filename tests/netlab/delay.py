"""Hold every packet queued on an NFQUEUE for a fixed delay, then accept it: latency where `tc netem` is missing.

Run inside a network namespace whose INPUT chain sends packets to queue N (`iptables -A INPUT -i eth0 -j NFQUEUE
--queue-num N --queue-bypass`): `python delay.py --queue N --delay-ms D`. Speaks nfnetlink_queue over a raw netlink
socket (stdlib only): binds the queue with metadata-only copies, reads each packet's id and arrival, and sends an
ACCEPT verdict once D ms have passed. Packets leave in arrival order (a constant delay keeps it: a FIFO is enough).
Prints "ready" once bound; SIGTERM ends it (the rule's --queue-bypass then lets packets through undelayed).
"""
from __future__ import annotations

import argparse
import collections
import errno
import os
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
PRIORITY = 10  # nice steps above normal (-10): released packets do not wait behind the servers' compute
QUEUE_MAXLEN = 65536  # packets the kernel holds for us (default 1024: too few for a bulk transfer at 50 ms)


def attribute(kind: int, payload: bytes) -> bytes:
    """One netlink attribute, padded to 4 bytes."""
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + bytes(-len(raw) % 4)


def message(kind: int, queue: int, attributes: bytes, *, flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    """A nfnetlink message of the queue subsystem: netlink header, nfgenmsg (AF_UNSPEC, v0, queue), attributes."""
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attributes
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + body


def attributes_of(payload: bytes) -> dict[int, bytes]:
    """A message's attributes by type (nested and byte-order flags masked off)."""
    found, offset = {}, 0
    while offset + 4 <= len(payload):
        length, kind = struct.unpack_from("=HH", payload, offset)
        if length < 4:
            break
        found[kind & 0x3FFF] = payload[offset + 4:offset + length]
        offset += (length + 3) & ~3
    return found


def bind(sock: socket.socket, queue: int) -> None:
    """Bind the queue, copy metadata only, lengthen it; raises OSError if the kernel refuses."""
    for seq, attrs in enumerate([attribute(NFQA_CFG_CMD, struct.pack("=BxH", NFQNL_CFG_CMD_BIND, 0)),
                                 attribute(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
                                 + attribute(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN))], start=1):
        sock.send(message(NFQNL_MSG_CONFIG, queue, attrs, flags=NLM_F_REQUEST | NLM_F_ACK, seq=seq))
        reply = sock.recv(65536)
        kind = struct.unpack_from("=H", reply, 4)[0]
        if kind == NLMSG_ERROR and (code := struct.unpack_from("=i", reply, 16)[0]) != 0:
            raise OSError(-code, f"nfqueue config refused: {errno.errorcode.get(-code, code)}")


def packet_ids(datagram: bytes) -> list[int]:
    """The ids of the queued packets announced in one datagram (it may hold several netlink messages)."""
    ids, offset = [], 0
    while offset + 16 <= len(datagram):
        length, kind = struct.unpack_from("=IH", datagram, offset)
        if length < 16:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            header = attributes_of(datagram[offset + 20:offset + length]).get(NFQA_PACKET_HDR)
            if header is not None:
                ids.append(struct.unpack_from("!I", header)[0])
        offset += (length + 3) & ~3
    return ids


def verdict(queue: int, packet_id: int) -> bytes:
    """ACCEPT one packet."""
    return message(NFQNL_MSG_VERDICT, queue, attribute(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id)))


def prefer_cpu() -> None:
    """Run PRIORITY nice steps above the processes under test (root), as a network's own hardware would: a link does not
    slow down when the machines at its ends compute, but on one box a delay program that waits for a busy core to
    release a packet adds that wait to the round trip (ping measures the lab idle). Without root it runs as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -PRIORITY)
    except OSError:
        pass


def run(queue: int, delay: float) -> None:
    """Serve the queue until SIGTERM."""
    prefer_cpu()
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE (root): a burst must not overflow it
    sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
    bind(sock, queue)
    print("ready", flush=True)
    held: collections.deque[tuple[float, int]] = collections.deque()
    while True:
        now = time.monotonic()
        while held and held[0][0] <= now:
            sock.send(verdict(queue, held.popleft()[1]))
        timeout = max(0.0, held[0][0] - now) if held else None
        if select.select([sock], [], [], timeout)[0]:
            arrived = time.monotonic()
            while True:
                try:
                    datagram = sock.recv(1 << 16, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                held.extend((arrived + delay, packet_id) for packet_id in packet_ids(datagram))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        run(args.queue, args.delay_ms / 1000)
    except OSError as e:
        print(f"nfqueue unavailable: {e}", file=sys.stderr, flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
