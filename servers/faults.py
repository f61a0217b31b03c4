"""TEST-ONLY fault injection: a server that computes wrong outputs, to test the clients' checked outputs.

Set SWARMBATCH_FAULT_INJECTION=noise:STD in a server's environment and every output of its span (inference
steps, merged decode batches and stateless forwards alike) gets Gaussian noise of that standard deviation added:
the server lies, as bad RAM, a wrong build or a compromised box would. With push-noise:STD the server answers its
client honestly but adds the noise to the outputs it pushes to the next server (and signs what it pushed, as its
push proof says: servers/push.py), the lie that push proofs catch (swarmnet/push_proof.py). Nothing else reads this variable; no
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
PUSH_FAULT_WARNING = ("TEST-ONLY FAULT INJECTION IS ON (%s=%s): this server adds Gaussian noise of std %g to every output "
                      "it pushes (its answers stay honest)")


FAULT_KINDS = ("noise", "push-noise")  # every output / only the outputs pushed to the next server


def parse_fault(value: str) -> tuple[str, float]:
    """'noise:STD' or 'push-noise:STD' -> (kind, STD); raises ServerConfigError on anything else."""
    kind, _, std = value.partition(":")
    try:
        parsed = float(std)
    except ValueError:
        parsed = -1.0
    if kind not in FAULT_KINDS or not parsed > 0:
        raise ServerConfigError(f"{FAULT_INJECTION_ENV}={value!r} is not noise:STD or push-noise:STD (a positive "
                                "number); unset it (it is for tests only)")
    return kind, parsed


def noise_std(value: str) -> float:
    """'noise:STD' or 'push-noise:STD' -> STD; raises ServerConfigError on anything else."""
    return parse_fault(value)[1]


def _fault(kind: str, *, private: bool) -> float | None:
    value = os.environ.get(FAULT_INJECTION_ENV, "")
    if not value:
        return None
    if private:
        raise ServerConfigError(f"{FAULT_INJECTION_ENV} is set, but it is for tests only and a server of a private "
                                "swarm (--swarm-file) refuses it; unset it")
    parsed_kind, std = parse_fault(value)
    return std if parsed_kind == kind else None


def fault_noise(*, private: bool) -> float | None:
    """The output noise SWARMBATCH_FAULT_INJECTION asks for (noise:STD), or None; refused in a private swarm."""
    return _fault("noise", private=private)


def push_fault_noise(*, private: bool) -> float | None:
    """The noise SWARMBATCH_FAULT_INJECTION asks for on pushed outputs only (push-noise:STD), or None; refused in a
    private swarm."""
    std = _fault("push-noise", private=private)
    if std is not None:
        logger.warning(PUSH_FAULT_WARNING, FAULT_INJECTION_ENV, os.environ.get(FAULT_INJECTION_ENV, ""), std)
    return std


def noisy(tensor: torch.Tensor, std: float | None) -> torch.Tensor:
    """`tensor` plus Gaussian noise of `std` (tests only); itself when `std` is None."""
    return tensor if std is None else tensor + torch.randn_like(tensor) * std


def inject_faults(span: nn.Module, std: float | None) -> None:
    """Make the span lie by `std` (fault_noise; tests only); None does nothing."""
    if std is None:
        return

    def add_noise(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return noisy(output, std)

    span.register_forward_hook(add_noise)
    logger.warning(FAULT_WARNING, FAULT_INJECTION_ENV, os.environ.get(FAULT_INJECTION_ENV, ""), std)
