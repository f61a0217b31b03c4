"""`ClientHead`: the parts of the model that stay on the client — token embeddings, final norm, LM head.

One copy of each weight, on the client's device. The embeddings stay in the checkpoint's dtype (a lookup costs the
same in any dtype, and they are what the first server is sent). The final norm and LM head are in the checkpoint's
dtype on a GPU; on a CPU they are float32 by default: on a CPU without bfloat16 instructions (AVX2 EPYC, bench/
client_memory.py) a bfloat16 GEMM over Llama-3-8B's head took 1.2x float32's time for 1 row and 3x for 16 rows,
so `head_dtype=torch.bfloat16` is for a client that needs the memory more than the speed. The LM head's product runs
in the faster of two equal forms for small row counts on a CPU (head_matmul.py).
"""
from __future__ import annotations

import torch
from torch import nn

from swarmnet.devices import resolve_device
from swarmnet.errors import ModelDirError
from swarmnet.head_matmul import HeadMatmul
from swarmnet.model_spec import ModelSpec


class ClientHead(nn.Module):
    """Embeddings in, logits out; loads only these tensors from the model's safetensors.

    `embed` and `logits` take and give CPU tensors (the wire's side); the weights and the compute are on `device`.
    """

    def __init__(self, spec: ModelSpec, *, device: str | torch.device = "auto",
                 head_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        config = spec.config
        self.device = resolve_device(device) if isinstance(device, str) else device
        self.embed_scale = spec.family.embed_scale(config)
        self.softcap: float | None = getattr(config, "final_logit_softcapping", None)
        with torch.device("meta"):  # no random init of [vocab, hidden] weights that are about to be replaced
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.norm = final_norm(spec)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._load(spec, head_dtype)
        self.head_matmul = HeadMatmul(self.lm_head.weight)
        self.eval()

    def _load(self, spec: ModelSpec, head_dtype: torch.dtype | None) -> None:
        spec.require(spec.head_prefixes)  # only these files must be on the box, each checked against the manifest
        embed, norm, head = (spec.load_tensors(prefix) for prefix in spec.head_prefixes)
        if "weight" not in embed or "weight" not in norm:
            raise ModelDirError(f"{spec.path}: embeddings or final norm missing from the safetensors files")
        model_dtype = embed["weight"].dtype
        self.head_dtype = head_dtype or (model_dtype if self.device.type == "cuda" else torch.float32)
        self.norm.load_state_dict({name: tensor.to(self.device, self.head_dtype) for name, tensor in norm.items()},
                                  strict=True, assign=True)
        # whether a ring server's copy of this head (servers/ring.py: LM head in float32) embeds a token in the same
        # dtype as this one, so that its guess of a step is byte for byte what this client sends
        self.embeds_as_ring = True
        if "weight" in head:
            self.lm_head.weight = self._weight(head.pop("weight"), self.head_dtype)
            self.embed_tokens.weight = self._weight(embed.pop("weight"), model_dtype)
        elif spec.config.tie_word_embeddings:  # one tensor for both, in the head's dtype
            self.lm_head.weight = self.embed_tokens.weight = self._weight(embed.pop("weight"), self.head_dtype)
            self.embeds_as_ring = self.head_dtype == torch.float32
        else:
            raise ModelDirError(f"{spec.path}: lm_head.weight is missing and embeddings are not tied")

    def _weight(self, tensor: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
        return nn.Parameter(tensor.to(self.device, dtype), requires_grad=False)

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> hidden states [B, T, H] on the CPU, in the embeddings' dtype (what the wire carries),
        times the family's embedding scale."""
        embeddings = self.embed_tokens(input_ids.to(self.device))
        if self.embed_scale != 1.0:  # as transformers does: the scale in the weights' dtype
            embeddings = embeddings * torch.tensor(self.embed_scale, dtype=embeddings.dtype, device=embeddings.device)
        return embeddings.cpu()

    @torch.inference_mode()
    def final_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [B, T, H] of any float dtype -> after the final norm (float32, on the CPU): what
        transformers' base model returns as last_hidden_state, the input of an embedding's pooling."""
        return self.norm(hidden.to(self.device, self.head_dtype)).float().cpu()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [B, T, H] of any float dtype -> logits [B, T, V] (float32, on the CPU)."""
        states = self.norm(hidden.to(self.device, self.head_dtype))
        logits = self.head_matmul(states.reshape(-1, states.shape[-1])).reshape(*states.shape[:-1], -1).float()
        if self.softcap is not None:  # Gemma 2's final-logit soft-capping
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.cpu()


def next_decode_inputs(mask: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention mask and position ids of the decode step after a step of these: the mask one column of ones
    longer, each row's position one past its last. One function for the client's decode loop and the ring server's
    guess (servers/ring.py), whose step must be the client's byte for byte."""
    return torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1), positions[:, -1:] + 1


def final_norm(spec: ModelSpec) -> nn.Module:
    """The family's final norm, empty (its weights are loaded after)."""
    config = spec.config
    if spec.family.norm == "LayerNorm":
        return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
    return spec.family_class(spec.family.norm)(config.hidden_size, eps=config.rms_norm_eps)  # type: ignore[no-any-return]
