"""Loading a server's span: only its blocks' tensors are read, then cast or quantized, then moved to the device.

Only the files holding the span's blocks must be on the box; each is checked against the weights manifest first
(swarmnet/manifest.py), or downloaded where the model is a Hugging Face id and the hub is reachable.

Tensors are read and cast on the CPU; bitsandbytes quantizes a linear layer when it is moved to its device (int8 /
nf4 on CUDA, their home, and on the CPU where bitsandbytes has a CPU backend), one layer at a time, so a GPU never
holds a block's full-precision weights.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from servers.config import DType, Quant
from servers.errors import ServerConfigError
from servers.span import BlockSpan
from swarmnet.model_spec import ModelSpec

logger = logging.getLogger(__name__)


def load_span(spec: ModelSpec, start: int, end: int, *, dtype: DType = DType.float32,
              quant: Quant = Quant.none, device: torch.device | str = "cpu") -> BlockSpan:
    """Build blocks [start, end) on `device` and fill them from the safetensors files (other blocks are never read)."""
    if not 0 <= start < end <= spec.num_blocks:
        raise ServerConfigError(f"blocks {start}:{end} are outside the model's 0:{spec.num_blocks}")
    spec.require(spec.block_prefixes(start, end))  # the span's files: here (or downloaded) and the manifest's
    with torch.device("meta"):
        span = BlockSpan(spec, start, end)
    for offset, index in enumerate(range(start, end)):
        state = spec.family.convert_block(spec.load_tensors(spec.family.layer_prefix_of(index)))
        if not state:
            raise ServerConfigError(f"{spec.path}: no tensors for block {index}")
        try:
            span.layers[offset].load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:
            detail = str(e).strip().splitlines()[-1].strip()
            raise ServerConfigError(f"{spec.path}: block {index} does not match the model config ({detail})") from e
    span.rotary_emb = spec.family_class("RotaryEmbedding")(spec.config)  # buffers computed, not loaded
    span.to(dtype.torch)
    span.compute_dtype = dtype.torch
    if quant != Quant.none:
        quantize_span(span, quant, torch.device(device))
    span.to(device)  # the norms (and, unquantized, every weight); quantized layers are there already
    span.device = torch.device(device)
    span.rotary_emb.to(torch.float32)
    logger.info("Loaded blocks %d:%d on %s as %s%s", start, end, device, str(dtype.torch).removeprefix("torch."),
                "" if quant == Quant.none else f" ({quant.value} weights)")
    return span.eval().requires_grad_(False)


def quantize_span(span: BlockSpan, quant: Quant, device: torch.device) -> None:
    """Replace the span's nn.Linear layers by bitsandbytes int8 / nf4 layers on `device`, in place."""
    bnb = _import_bitsandbytes(quant)
    for layer in span.layers:
        for _name, module in list(layer.named_modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, child_name, _quantized_linear(bnb, child, quant, span.compute_dtype, device))
    logger.info("Quantized blocks %d:%d to %s", span.start, span.end, quant.value)


def _quantized_linear(bnb: object, linear: nn.Linear, quant: Quant, compute_dtype: torch.dtype,
                      device: torch.device) -> nn.Module:
    weight = linear.weight.data.float()
    has_bias = linear.bias is not None
    if quant == Quant.int8:
        new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=has_bias,  # type: ignore[attr-defined]
                                  has_fp16_weights=False, threshold=6.0)
        new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)  # type: ignore[attr-defined]
    else:
        new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=has_bias,  # type: ignore[attr-defined]
                                compute_dtype=compute_dtype, quant_type="nf4")
        new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")  # type: ignore[attr-defined]
    if has_bias:
        new.bias = nn.Parameter(linear.bias.data.to(compute_dtype), requires_grad=False)
    return new.to(device)  # moving the parameters is what quantizes them


def _import_bitsandbytes(quant: Quant) -> object:
    try:
        import bitsandbytes as bnb
    except Exception as e:  # ImportError, or a broken native library on this platform
        raise ServerConfigError(f"--quant {quant.value} needs bitsandbytes, which failed to load ({e}); "
                                "install 'swarmbatch[quant]' or use --quant none") from e
    # int8 layers log a warning on every call; it floods the log and slows decoding
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    return bnb
