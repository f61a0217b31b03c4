"""Whole sequences through every block of the swarm, statelessly: no session and no KV cache on the servers.

For work that needs the final hidden states of whole texts once (embeddings), not token by token: each hop is one
`forward` RPC of the span's blocks (Swarm.forward_hidden). A failed hop bans its server and routes its blocks again
from where it started; the hops before it are not repeated, since their outputs are in hand. With `verify_fraction`,
a sampled hop is recomputed on another holder (HopVerifier, as a session's steps are): a server found lying is banned
for good and its hop is run again through others.
"""
from __future__ import annotations

import logging
import uuid

import torch

from swarmclient.errors import NoRoom, PeerFailed, WrongOutput
from swarmclient.generation import prefill_positions
from swarmclient.hop_verifier import HopCheck, HopVerifier
from swarmclient.retry import with_retries
from swarmclient.swarm import Swarm
from swarmclient.verification_policy import Verdict, VerificationTally, sampled

logger = logging.getLogger(__name__)


def forward_chain(swarm: Swarm, hidden: torch.Tensor, attention_mask: torch.Tensor,
                  verification: VerificationTally | None = None) -> torch.Tensor:
    """Hidden states [B, T, H] of a (left- or right-) padded batch -> the last block's outputs [B, T, H].

    verification: where the checked hops are counted (ClientConfig.verify_fraction), e.g. one per job."""
    return swarm.loop.run(aforward_chain(swarm, hidden, attention_mask, verification))


async def aforward_chain(swarm: Swarm, hidden: torch.Tensor, attention_mask: torch.Tensor,
                         verification: VerificationTally | None = None) -> torch.Tensor:
    """Async `forward_chain`: hop by hop, each with the client's retry policy."""
    mask = attention_mask.long()
    positions = prefill_positions(mask)
    verifier = HopVerifier(swarm, verification or VerificationTally(), uuid.uuid4().hex)
    block = 0
    while block < swarm.num_blocks:
        sent = hidden
        hidden, block = await with_retries(lambda: _hop(swarm, verifier, block, sent, mask, positions),  # noqa: B023 - awaited now
                                           config=swarm.config, on_failure=lambda exc: _ban(swarm, exc))
    return hidden


async def _hop(swarm: Swarm, verifier: HopVerifier, start: int, hidden: torch.Tensor, mask: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The first hop of the best route from `start`, checked when sampled: its outputs and the block after it."""
    hop = (await swarm.route(start, swarm.num_blocks))[0]
    output = await swarm.forward_hidden(hop.peer_id, hop.start, hop.end, hidden, mask, positions)
    if sampled(swarm.config.verify_fraction, verifier.key, 0, hop.start):
        verdict = await verifier.check(hop, 0, lambda: HopCheck(hop, hidden, mask, positions, output))
        if verdict is Verdict.CHECKED_FAULTY:
            raise WrongOutput(hop.peer_id, "its output differs from other servers' (banned for good)")
    swarm.bans.forgive(hop.peer_id)
    return output, hop.end


async def _ban(swarm: Swarm, exc: BaseException) -> None:
    if isinstance(exc, PeerFailed) and not isinstance(exc, WrongOutput):  # the verifier banned it for good
        duration = swarm.ban(exc)
        logger.warning("Server %s %s (%s) in a forward; %s for %.0f s, routing around it", exc.peer_id[-8:],
                       *(("has no room", exc.reason, "skipped") if isinstance(exc, NoRoom) else
                         ("failed", exc.reason, "banned")), duration)
