"""Errors of the launchers (processes this machine starts: the demo's and the tests' DHT, servers and workers).

    LaunchError          root
    └── ProcessNotReady  a child process exited, or did not print its ready line in time (its log says why)
"""
from __future__ import annotations


class LaunchError(Exception):
    """Root of launcher errors."""


class ProcessNotReady(LaunchError):
    """Raised when a child process exits or stays silent before its ready line; read its log, fix, start again."""
