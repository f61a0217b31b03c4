"""Background compute: the thread that runs stateless forwards at a lower CPU priority than inference steps.

A stateless forward recomputes whole sequences (another client's check of a hop step, an embeddings batch): a prefill
of rows x tokens, long next to a decode step. On a CPU server both compete for the same cores, and a check that runs
at the same priority as the sessions' steps slows every session on the server while it lasts. Its thread runs
BACKGROUND_NICE nice steps lower instead, so the kernel gives the server's (and the box's) inference work the CPU first and the
forward the rest; alone, a forward runs as fast as before. Lowering a thread's own priority needs no privilege; where
the platform has no per-thread priority, the forward runs at normal priority. (On a GPU the kernels queue on the
device: the nice value only orders the CPU side.)
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)
BACKGROUND_NICE = 10  # CFS weight 110 against 1024 at nice 0: about a tenth of a contended core


def lower_priority() -> None:
    """Run the calling thread BACKGROUND_NICE nice steps below the process (Linux: a thread is a task with its own
    nice value; 19 at most)."""
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + BACKGROUND_NICE))
    except (AttributeError, OSError) as e:  # not Linux, or a sandbox refusing it: forwards run at normal priority
        logger.debug("Could not lower the background thread's priority: %s", e)


def background_executor() -> ThreadPoolExecutor:
    """One thread at a lower priority, for stateless forwards."""
    return ThreadPoolExecutor(1, "swarmbatch-background", initializer=lower_priority)
