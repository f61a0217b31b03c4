"""--device and --dtype of a server, as they resolve on this machine (the CUDA paths: tests/test_gpu.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from servers.block_loading import load_span
from servers.config import DType, ServerConfig
from servers.errors import ServerConfigError
from swarmnet.model_spec import ModelSpec

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")


def config(**options: object) -> ServerConfig:
    return ServerConfig("model", [], num_blocks=1, **options)  # type: ignore[arg-type]


@no_cuda
def test_auto_is_the_cpu_in_float32_on_a_machine_without_a_gpu() -> None:
    chosen = config()
    assert (chosen.torch_device(), chosen.compute_dtype()) == (torch.device("cpu"), DType.float32)
    assert config(dtype=DType.float16).compute_dtype() is DType.float16


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_cuda_device_on_a_machine_without_one_is_refused_in_one_line(device: str) -> None:
    with pytest.raises(ServerConfigError, match=f"--device: device '{device}' asked for, but torch sees no CUDA GPU") \
            as refused:
        config(device=device)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("device", ["tpu", "gpu0", "mps"])
def test_an_unknown_device_is_refused_with_the_choices(device: str) -> None:
    with pytest.raises(ServerConfigError, match="use auto, cpu, cuda or cuda:N"):
        config(device=device)


def test_dtype_auto_has_no_torch_dtype_until_resolved() -> None:
    with pytest.raises(ValueError, match="resolve it"):
        _ = DType.auto.torch
    assert [d.torch for d in (DType.float32, DType.bfloat16, DType.float16)] == \
        [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", [DType.bfloat16, DType.float16])
def test_a_half_precision_span_answers_on_the_cpu_in_its_dtype_close_to_float32(tiny_model: Path,
                                                                                dtype: DType) -> None:
    spec = ModelSpec.open(tiny_model)
    hidden = torch.randn(2, 5, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    mask, positions = torch.ones(2, 5, dtype=torch.long), torch.arange(5).repeat(2, 1)
    exact = load_span(spec, 0, 6, device="cpu")(hidden, mask, positions)
    half = load_span(spec, 0, 6, dtype=dtype, device="cpu")(hidden, mask, positions)
    assert (half.dtype, half.device.type) == (dtype.torch, "cpu")
    assert (half.float() - exact).abs().max() / exact.abs().max() < 0.05
