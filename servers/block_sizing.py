"""How many blocks a server started with neither --blocks nor --num-blocks takes: as many as fit the memory it may use
(the device's free memory, or --max-memory-gb), each block counted as its weights as served plus its KV-cache budget
(--attn-cache-tokens), with MEMORY_MARGIN of that memory left for activations, the allocator and the system (as
Petals sizes its servers). Where the span goes is then chosen like --num-blocks (block_selection).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from servers.config import DType, Quant
from servers.errors import ServerConfigError
from swarmnet.model_spec import ModelSpec

logger = logging.getLogger(__name__)

MEMORY_MARGIN = 0.1  # of the memory a server may use, kept free for activations, the allocator and the system
QUANTIZED_BYTES = {Quant.none: None, Quant.int8: 1.0, Quant.nf4: 0.5}  # bytes per linear weight, bitsandbytes
GIB = 1024 ** 3


@dataclass(frozen=True)
class BlockFootprint:
    """The memory one block takes on the server, in bytes."""

    weights: int  # its parameters as served (dtype, or quantized linear weights)
    cache: int    # its KV-cache budget: --attn-cache-tokens of keys and values

    @property
    def total(self) -> int:
        return self.weights + self.cache


def block_footprint(spec: ModelSpec, dtype: DType, quant: Quant, cache_tokens: int) -> BlockFootprint:
    """Block 0's weights (built on the meta device: nothing is read or allocated) and its cache budget."""
    from servers.span import BlockSpan  # transformers' modeling: loaded by the server anyway

    with torch.device("meta"):
        block = BlockSpan(spec, 0, 1).layers[0]
    itemsize = dtype.torch.itemsize
    linear = sum(m.weight.numel() for m in block.modules() if isinstance(m, nn.Linear))
    other = sum(p.numel() for p in block.parameters()) - linear
    per_linear = QUANTIZED_BYTES[quant] or itemsize
    return BlockFootprint(int(linear * per_linear + other * itemsize),
                          cache_tokens * kv_bytes_per_token(spec.config, itemsize))


def kv_bytes_per_token(config: Any, itemsize: int) -> int:
    """Keys and values of one token in one block."""
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None) or heads
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        kv_heads = 1  # Falcon-7B's multi-query attention
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * int(kv_heads) * int(head_dim) * itemsize


def free_memory(device: torch.device) -> int:
    """Bytes free now on the device: the GPU's, or this machine's available memory for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def spare_memory(spec: ModelSpec, device: torch.device, dtype: DType, quant: Quant, cache_tokens: int, blocks: int,
                 max_memory_gb: float = 0.0) -> int:
    """Bytes a server holding `blocks` loaded blocks may still take beyond them and their KV-cache budget (allocated
    as sessions come): --max-memory-gb less the blocks' footprint, or what the device has free now less the budget;
    MEMORY_MARGIN of either kept free, as when sizing the span. A second copy of the weights is kept only in this."""
    footprint = block_footprint(spec, dtype, quant, cache_tokens)
    if max_memory_gb > 0:
        return max(0, int(max_memory_gb * GIB * (1 - MEMORY_MARGIN)) - blocks * footprint.total)
    return max(0, int(free_memory(device) * (1 - MEMORY_MARGIN)) - blocks * footprint.cache)


def blocks_that_fit(memory: int, footprint: BlockFootprint, num_blocks: int) -> int:
    """How many blocks fit in `memory` bytes less the margin (at most the model's)."""
    return max(0, min(num_blocks, int(memory * (1 - MEMORY_MARGIN)) // max(1, footprint.total)))


def size(count: int) -> str:
    """Bytes for a log line: '1.25 GiB', '12.0 MiB'."""
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / 2 ** 20:.1f} MiB"


def auto_num_blocks(spec: ModelSpec, device: torch.device, dtype: DType, quant: Quant, cache_tokens: int,
                    max_memory_gb: float = 0.0) -> int:
    """The blocks to serve; says what it chose and why in one log line; ServerConfigError if not even one fits."""
    footprint = block_footprint(spec, dtype, quant, cache_tokens)
    free = free_memory(device)
    memory, source = (int(max_memory_gb * GIB), f"--max-memory-gb {max_memory_gb:g}") if max_memory_gb > 0 \
        else (free, f"{size(free)} free on {device}")
    count = blocks_that_fit(memory, footprint, spec.num_blocks)
    why = (f"{source} ({MEMORY_MARGIN:.0%} kept free), each block {size(footprint.weights)} of weights "
           f"({dtype.value}{'' if quant == Quant.none else ', ' + quant.value}) + {size(footprint.cache)} of KV cache "
           f"({cache_tokens} tokens)")
    if count < 1:
        raise ServerConfigError(f"not even one block fits: {why}; free memory, lower --attn-cache-tokens, quantize "
                                "(--quant), or pass --num-blocks")
    logger.info("Serving %d of %d blocks: %s", count, spec.num_blocks, why)
    return count
