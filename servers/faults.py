"""TEST-ONLY fault injection: a server that computes wrong outputs, to test the clients' checked outputs.

Set SWARMBATCH_FAULT_INJECTION=noise:STD in a server's environment and every output of its span (inference
steps, merged decode batches and stateless forwards alike) gets Gaussian noise of that standard deviation added:
the server lies, as bad RAM, a wrong build or a compromised box would. Nothing else reads this variable; no
command-line option sets it, and the server logs a loud warning at start when it is set. A server of a private swarm
(--swarm-file) refuses to start with it. Never set it in production: such a server corrupts every generation that
is not checked.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from servers.errors import ServerConfigError

logger = logging.getLogger(__name__)
FAULT_INJECTION_ENV = "SWARMBATCH_FAULT_INJECTION"
FAULT_WARNING = "TEST-ONLY FAULT INJECTION IS ON (%s=%s): this server adds Gaussian noise of std %g to every output"


def noise_std(value: str) -> float:
    """'noise:STD' -> STD; raises ServerConfigError on anything else."""
    kind, _, std = value.partition(":")
    try:
        parsed = float(std)
    except ValueError:
        parsed = -1.0
    if kind != "noise" or not parsed > 0:
        raise ServerConfigError(f"{FAULT_INJECTION_ENV}={value!r} is not noise:STD (a positive number); "
                                "unset it (it is for tests only)")
    return parsed


def fault_noise(*, private: bool) -> float | None:
    """The noise SWARMBATCH_FAULT_INJECTION asks for, or None when it is unset; refused in a private swarm."""
    value = os.environ.get(FAULT_INJECTION_ENV, "")
    if not value:
        return None
    if private:
        raise ServerConfigError(f"{FAULT_INJECTION_ENV} is set, but it is for tests only and a server of a private "
                                "swarm (--swarm-file) refuses it; unset it")
    return noise_std(value)


def inject_faults(span: nn.Module, std: float | None) -> None:
    """Make the span lie by `std` (fault_noise; tests only); None does nothing."""
    if std is None:
        return

    def add_noise(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output + torch.randn_like(output) * std

    span.register_forward_hook(add_noise)
    logger.warning(FAULT_WARNING, FAULT_INJECTION_ENV, os.environ.get(FAULT_INJECTION_ENV, ""), std)
