"""Where tensors live: `--device auto|cpu|cuda|cuda:N` resolved against what torch sees, and the default dtype there.

Servers (`serve --device`, `--dtype auto`) and clients (`ClientConfig.device`) resolve the same way: auto is the
GPU when torch sees one, else the CPU; the default compute dtype is float32 on a CPU, bfloat16 on a GPU that
supports it, else float16.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


class DeviceUnavailable(ValueError):
    """A device name that is malformed or names a GPU this machine does not have (not retryable)."""


def resolve_device(name: str) -> torch.device:
    """The torch device of `name` (auto|cpu|cuda|cuda:N); raises DeviceUnavailable with a one-line reason."""
    import torch  # not at module level: config modules import this while building CLI help

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise DeviceUnavailable(f"unknown device {name!r}: use {DEVICE_CHOICES}") from e
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise DeviceUnavailable(f"device {name!r} is not supported: use {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        raise DeviceUnavailable(f"device {name!r} asked for, but torch sees no CUDA GPU here (torch "
                                f"{torch.__version__}); use --device cpu, or install a CUDA build of torch")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise DeviceUnavailable(f"device {name!r} asked for, but torch sees {torch.cuda.device_count()} GPU(s) "
                                f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on a CPU; on a GPU bfloat16 where it is supported (Ampere and later), else float16."""
    import torch

    if device.type != "cuda":
        return torch.float32
    with torch.cuda.device(device):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def dtype_name(dtype: torch.dtype) -> str:
    """'float32', 'bfloat16', ...: how the wire and the DHT records name a dtype."""
    return str(dtype).removeprefix("torch.")
