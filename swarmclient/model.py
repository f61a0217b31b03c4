"""`DistributedModelForCausalLM`: the Petals-style entry point — a local head over remote blocks."""
from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from swarmclient.config import ClientConfig
from swarmclient.deferred_checks import DeferredChecks
from swarmclient.errors import InvalidRequest
from swarmclient.forward import forward_chain
from swarmclient.generation import TokenHook, generate_tokens, leading_padding
from swarmclient.pooling import Pooling, PoolingMode, pool, read_pooling
from swarmclient.sampling import SamplingParams, all_greedy
from swarmclient.session import InferenceSession
from swarmclient.swarm import Swarm
from swarmclient.verification_policy import VerificationTally
from swarmnet.addresses import NetworkOptions
from swarmnet.head import ClientHead
from swarmnet.membership import SwarmAccess
from swarmnet.model_spec import ModelSpec


class DistributedModelForCausalLM:
    """Generate with a model whose blocks are served by the swarm; embeddings and LM head run here."""

    def __init__(self, spec: ModelSpec, head: ClientHead, swarm: Swarm) -> None:
        self.spec, self.head, self.swarm = spec, head, swarm
        config = spec.config
        self.eos_token_ids: set[int] = spec.eos_token_ids
        self.pad_token_id: int = config.pad_token_id if config.pad_token_id is not None else min(self.eos_token_ids, default=0)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str], *, initial_peers: Sequence[str],
                        config: ClientConfig | None = None, network: NetworkOptions | None = None,
                        access: SwarmAccess | None = None) -> DistributedModelForCausalLM:
        """Load the local head from `model_dir` and join the swarm that serves its blocks.

        access: a private swarm's membership and this client's member key (`SwarmAccess.load`); default: open.
        The head's device and dtype are config.device and config.head_dtype (default: a GPU when torch sees one).
        """
        spec = ModelSpec.open(model_dir)
        config = config or ClientConfig()
        head = ClientHead(spec, device=config.device,
                          head_dtype=None if config.head_dtype == "auto" else getattr(torch, config.head_dtype))
        swarm = Swarm.connect(initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks,
                              config=config, network=network, access=access)
        return cls(spec, head, swarm)

    def close(self) -> None:
        """Leave the swarm."""
        self.swarm.close()

    def __enter__(self) -> DistributedModelForCausalLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def inference_session(self, *, batch_size: int, max_length: int, verification: VerificationTally | None = None,
                          deferred: DeferredChecks | None = None, ring: bool = False) -> InferenceSession:
        """A session for step-by-step use: `with model.inference_session(...) as s: s.step(h, mask, pos)`.

        verification: where its checked outputs are counted (ClientConfig.verify_fraction), e.g. one per job.
        deferred: run the checks beside the steps (deferred_checks.py); the caller settles them before it keeps tokens.
        ring: the caller decodes greedily and feeds every row its argmax token, finished rows too, with no keep_rows:
        a last server that holds the head may guess each next step (ClientConfig.ring, servers/ring.py).
        """
        return InferenceSession(self.swarm, batch_size=batch_size, max_length=max_length, verification=verification,
                                deferred=deferred, ring=ring)

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | Sequence[int] = 0,
        **unused: Any,
    ) -> torch.Tensor:
        """Like transformers' `generate`: returns prompt + new tokens [B, T + N], pad after EOS."""
        if unused:
            raise TypeError(f"unsupported generate options: {', '.join(unused)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        new = self.generate_new_tokens(input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                       params=self.sampling_params(input_ids.shape[0], do_sample, temperature,
                                                                   top_p, seed))
        return torch.cat([input_ids, new.to(input_ids.dtype)], dim=1)

    def generate_new_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                            max_new_tokens: int | Sequence[int], params: list[SamplingParams],
                            on_token: TokenHook | None = None, shrink: bool = False,
                            verification: VerificationTally | None = None, deferred: DeferredChecks | None = None,
                            micro_batches: int | None = None) -> torch.Tensor:
        """Only the new tokens [B, N], with per-row sampling parameters and limits (see generate_tokens).

        shrink: finished rows leave the session at once (continuous batching), instead of riding along.
        verification: counts the session's checked outputs (see inference_session).
        deferred: the session's checks run beside it (see inference_session); all are settled before this returns.
        micro_batches: run the rows as this many micro-batches at once (default ClientConfig.micro_batches); not
        with on_token or deferred, which follow one session.
        """
        total = input_ids.shape[1] + (max_new_tokens if isinstance(max_new_tokens, int) else max(max_new_tokens, default=0))
        if total > self.spec.max_length:
            raise InvalidRequest(f"prompt ({input_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds the "
                                 f"model's context of {self.spec.max_length} tokens")
        groups = micro_batch_rows(attention_mask, micro_batches or self.swarm.config.micro_batches)
        if len(groups) > 1 and on_token is None and deferred is None:
            return self._generate_micro_batches(groups, input_ids, attention_mask, max_new_tokens, params, shrink,
                                                verification)
        ring = self.swarm.config.ring and not shrink and all_greedy(params) and self.head.embeds_as_ring
        with self.inference_session(batch_size=input_ids.shape[0], max_length=total,
                                    verification=verification, deferred=deferred, ring=ring) as session:
            return generate_tokens(self.head, session.step, input_ids, attention_mask,
                                   max_new_tokens=max_new_tokens, params=params,
                                   eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id,
                                   on_token=on_token, shrink=shrink, feed_argmax=ring)

    def _generate_micro_batches(self, groups: list[torch.Tensor], input_ids: torch.Tensor,
                                attention_mask: torch.Tensor, max_new_tokens: int | Sequence[int],
                                params: list[SamplingParams], shrink: bool,
                                verification: VerificationTally | None) -> torch.Tensor:
        """generate_new_tokens of each group of rows in its own session, all at once (ClientConfig.micro_batches)."""
        limits = [max_new_tokens] * len(params) if isinstance(max_new_tokens, int) else list(max_new_tokens)

        def one(rows: list[int], ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.generate_new_tokens(ids, mask, max_new_tokens=[limits[r] for r in rows],
                                            params=[params[r] for r in rows], shrink=shrink,
                                            verification=verification, micro_batches=1)
        return in_micro_batches(groups, input_ids, attention_mask, self.pad_token_id, one)

    @functools.cached_property
    def pooling(self) -> Pooling:
        """How this model makes an embedding (swarmclient.pooling: its sentence-transformers modules, or the default)."""
        return read_pooling(self.spec.path, self.spec.config)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, mode: PoolingMode | None = None,
               verification: VerificationTally | None = None) -> torch.Tensor:
        """Pooled final hidden states [B, H] (float32) of a padded batch, by one stateless forward through the swarm
        (no KV cache): embeddings, final norm and pooling (`mode`, default the model's) here. Truncate and normalize
        with `swarmclient.pooling.finish`. verification: counts the checked hops (see inference_session)."""
        if input_ids.shape[1] > self.spec.max_length:
            raise InvalidRequest(f"an input of {input_ids.shape[1]} tokens exceeds the model's context of "
                                 f"{self.spec.max_length} tokens")
        hidden = forward_chain(self.swarm, self.head.embed(input_ids), attention_mask, verification)
        return pool(self.head.final_states(hidden), attention_mask, mode or self.pooling.mode)

    @staticmethod
    def sampling_params(batch_size: int, do_sample: bool, temperature: float, top_p: float,
                        seed: int | Sequence[int]) -> list[SamplingParams]:
        """Per-row SamplingParams from generate()'s arguments (a seed per row, or one for all)."""
        seeds = [seed] * batch_size if isinstance(seed, int) else list(seed)
        if len(seeds) != batch_size:
            raise ValueError(f"{len(seeds)} seeds for a batch of {batch_size}")
        return [SamplingParams(temperature=temperature if do_sample else 0.0, top_p=top_p, seed=s) for s in seeds]


def micro_batch_rows(attention_mask: torch.Tensor, count: int) -> list[torch.Tensor]:
    """The batch's row indices in at most `count` groups of near-equal size, rows of similar prompt length together
    (less padding in each group); one group of every row when count is 1."""
    rows = attention_mask.shape[0]
    if count <= 1 or rows < 2:
        return [torch.arange(rows)]
    by_length = torch.argsort(attention_mask.long().sum(dim=1), stable=True)
    return [group for group in torch.tensor_split(by_length, min(count, rows)) if len(group)]


MicroBatchFn = Callable[[list[int], torch.Tensor, torch.Tensor], torch.Tensor]
"""(the group's row indices, its input ids, its attention mask) -> its new tokens [rows, N]."""


def in_micro_batches(groups: list[torch.Tensor], input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int,
                     generate: MicroBatchFn) -> torch.Tensor:
    """The new tokens [B, N] of a batch whose groups of rows each `generate` in a thread of its own, all at once. A
    group's prompts lose the padding columns none of its rows needs (positions come from the mask: unchanged)."""
    def one(rows: torch.Tensor) -> torch.Tensor:
        first = leading_padding(attention_mask[rows])
        first = 0 if first == attention_mask.shape[1] else first  # a group of nothing but padding goes as it is
        return generate(rows.tolist(), input_ids[rows, first:], attention_mask[rows, first:])
    with ThreadPoolExecutor(len(groups), thread_name_prefix="micro-batch") as pool:
        outputs = list(pool.map(one, groups))
    new = torch.full((input_ids.shape[0], max(out.shape[1] for out in outputs)), pad_id, dtype=torch.long)
    for rows, out in zip(groups, outputs, strict=True):
        new[rows, :out.shape[1]] = out
    return new
