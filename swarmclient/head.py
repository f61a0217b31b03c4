"""`ClientHead`: the parts of the model that stay on the client — token embeddings, final norm, LM head."""
from __future__ import annotations

import torch
from torch import nn

from swarmnet.errors import ModelDirError
from swarmnet.model_spec import ModelSpec

FEW_ROWS = 4
"""Below this many rows, MKL's GEMM runs one GEMV per row over the [vocab, hidden] LM head, and on a CPU that
reads the weight at half the memory bandwidth that a GEMV over the [hidden, vocab] layout reaches (SmolLM2: 10.5
vs 5.7 ms a row, one thread); from 4 rows on, GEMM packs the weight itself and the usual layout is as fast or
faster (README, "Client LM head")."""


class ClientHead(nn.Module):
    """Embeddings in, logits out; loads only these tensors from the model's safetensors.

    It also keeps the LM head transposed ([hidden, vocab], one more copy of the head's weight): on a CPU, logits
    of fewer than FEW_ROWS rows (batch-1 decoding, the last rows of a batch) come from it twice as fast. Those
    logits differ from `nn.Linear`'s by float32 rounding (another summation order), as `nn.Linear`'s own logits
    for a row differ between batch sizes (1 row vs the same row among 4: up to 2e-6 on a head of SmolLM2's shape).
    """

    lm_head_columns: torch.Tensor

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        config, family = spec.config, spec.family
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = family.embed_scale(config)
        self.softcap: float | None = getattr(config, "final_logit_softcapping", None)
        self.norm = final_norm(spec)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._load(spec)
        self.to(dtype).eval()
        self.register_buffer("lm_head_columns", self.lm_head.weight.detach().T.contiguous(), persistent=False)

    def _load(self, spec: ModelSpec) -> None:
        embed = spec.load_tensors(spec.family.embed_prefix)
        norm = spec.load_tensors(spec.family.norm_prefix)
        head = spec.load_tensors("lm_head.")
        if "weight" not in embed or "weight" not in norm:
            raise ModelDirError(f"{spec.path}: embeddings or final norm missing from the safetensors files")
        self.embed_tokens.weight = nn.Parameter(embed["weight"], requires_grad=False)
        self.norm.load_state_dict(norm, strict=True, assign=True)
        if "weight" in head:
            self.lm_head.weight = nn.Parameter(head["weight"], requires_grad=False)
        elif spec.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            raise ModelDirError(f"{spec.path}: lm_head.weight is missing and embeddings are not tied")

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> hidden states [B, T, H] (float32), times the family's embedding scale."""
        embeddings = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:  # as transformers does: the scale in the weights' dtype
            embeddings = embeddings * torch.tensor(self.embed_scale, dtype=embeddings.dtype)
        return embeddings.float()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [B, T, H] -> logits [B, T, V] (float32)."""
        hidden = self.norm(hidden.to(self.lm_head.weight.dtype))
        if hidden.shape[0] * hidden.shape[1] < FEW_ROWS and hidden.device.type == "cpu":
            logits = (hidden @ self.lm_head_columns).float()
        else:
            logits = self.lm_head(hidden).float()
        if self.softcap is not None:  # Gemma 2's final-logit soft-capping
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def final_norm(spec: ModelSpec) -> nn.Module:
    """The family's final norm, empty (its weights are loaded after)."""
    config = spec.config
    if spec.family.norm == "LayerNorm":
        return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
    return spec.family_class(spec.family.norm)(config.hidden_size, eps=config.rms_norm_eps)  # type: ignore[no-any-return]
