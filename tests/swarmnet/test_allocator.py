"""keep_freed_memory: a process reuses freed memory for its next step's buffers instead of faulting in new pages."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.swarm  # each test starts Python processes
ROOT = Path(__file__).resolve().parents[2]

# A step's buffers: 3 x 8 MiB taken from glibc's malloc, written, freed, ten times over, after a 10 MiB block (glibc
# raises its own thresholds to the biggest freed block it saw): the page faults they take. {setup} runs first.
STEPS = """
import ctypes, resource
{setup}
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
MIB = 1 << 20
block = libc.malloc(10 * MIB); ctypes.memset(block, 1, 10 * MIB); libc.free(block)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    buffers = [libc.malloc(8 * MIB) for _ in range(3)]
    for buffer in buffers:
        ctypes.memset(buffer, 1, 8 * MIB)
    for buffer in buffers:
        libc.free(buffer)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_of(setup: str, **env: str) -> int:
    done = subprocess.run([sys.executable, "-c", STEPS.format(setup=setup)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_kept_freed_memory_takes_no_page_faults_where_glibc_defaults_take_thousands() -> None:
    default = faults_of("")
    tuned = faults_of("from swarmnet.allocator import keep_freed_memory; assert keep_freed_memory()")
    # glibc 2.36: 61,000 faults (every step's 24 MiB is new memory) against 3,600 (the first step's)
    assert default > 30000 and tuned < default / 5, (tuned, default)


def test_every_swarmbatch_command_keeps_freed_memory_unless_turned_off() -> None:
    # the CLI's root callback runs before every command (serve, worker, generate, demo, api)
    root = "import cli; cli.root(verbose=False)"
    on, off = faults_of(root), faults_of(root, SWARMBATCH_MALLOC_TUNING="0")
    assert off > 30000 and on < off / 5, (on, off)
