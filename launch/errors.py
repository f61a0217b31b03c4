"""Errors of the launchers (processes this machine starts: the demo's and the tests' DHT, servers and workers).

    LaunchError          root
    ├── ProcessNotReady  a child process exited, or did not print its ready line in time (its log says why)
    └── RunInterrupted   Ctrl-C stopped `swarmbatch run`: its processes are stopped, its job kept to resume
"""
from __future__ import annotations


class LaunchError(Exception):
    """Root of launcher errors."""


class ProcessNotReady(LaunchError):
    """Raised when a child process exits or stays silent before its ready line; read its log, fix, start again."""


class RunInterrupted(LaunchError):
    """Raised when Ctrl-C stops `swarmbatch run`: every process it started is stopped, the job is kept; run again."""
