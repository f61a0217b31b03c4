"""The ring, the last server's side: guess a session's next step from its last output and push it to the first server.

With push, a token costs (hops + 1) / 2 round trips: the client sends a step to the first server, each server pushes
on, and the last one answers the client, which samples the next token and sends its step. A server started with
`--ring` whose span ends at the model's last block also holds the model's head (swarmnet/head.py: embeddings, final
norm, LM head). A client whose rows all decode greedily opens its last hop's session with "ring_to" (the first hop's
peer and session) and its first hop's with "ring_from". After each decode step of such a session (not after a
prompt's: a long one may come as several steps through a relay, the next one more of it), this server takes the
argmax of its output's last position, embeds it, and pushes that next step to the first server ("guess": true, with
its push proof, routed on through the hops as the client would route it), beside its answer to the client. A token
then goes round the servers alone: hops / 2 round trips plus compute (one for 2 servers, instead of 1.5).

The client still samples every token itself and sends every step. The first server applies a guess only after the
client's own copy of the step before came and matched (handler.py), so the ring is never more than one step ahead of
the client; the client's copy of a guessed step is then a duplicate, answered from the guessed one, and pushed on from
there where the guessed step's own push on failed (its report came before the client sent the step, when the client
could not act on it). Where the guess was not the client's token (a near tie between two heads, a server that lies),
the first server's answer names the guessed input, and the client's push audit takes it for a stale input: it replays
the session to new server sessions, without the ring. A guess push that fails is not reported: the client sends that
step itself anyway. Such a server then stops guessing for that session.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from servers.sessions import AppliedStep, Session
from servers.validation import MAX_PEER_ID, validate_route
from swarmnet.head import ClientHead, next_decode_inputs
from swarmnet.model_spec import ModelSpec
from swarmnet.push_proof import input_digest

# the log line of a server that holds the head for the ring (tests read it)
RING_HEAD_LOG = "Holding the model's head for the ring (--ring): greedy clients' next steps are guessed here"


class RingGuesser:
    """A model's head on a ring server: the next greedy step of a session from the output of its last step."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        # the head in float32 wherever it runs, as a client on a CPU holds it: the same argmax, the same embeddings
        self.head = ClientHead(spec, device=device, head_dtype=torch.float32)
        self.num_blocks = spec.num_blocks  # only a session that ends at the last block guesses

    @torch.inference_mode()
    def next_step(self, output: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden, mask, positions) of the step after one whose last hop's output is `output` [B, T, H], as a greedy
        client builds it (swarmclient/generation.py): each row's argmax token after its last position, embedded; the
        mask one column longer; the positions one past the last."""
        token = self.head.logits(output[:, -1:, :])[:, -1, :].argmax(-1)
        return self.head.embed(token[:, None]).contiguous(), *next_decode_inputs(mask, positions)


def ring_of(meta: dict[str, Any], start: int, end: int, guesser: RingGuesser | None, may_push_to: Callable[[str], bool],
            may_push_here: Callable[[str], bool]) -> tuple[list[tuple[str, str]] | None, str | None]:
    """A push session's part in the ring, as its open message asks and this server can take it: (the route a last hop
    pushes its guesses along, the first hop's last server whose guesses it takes); None where it has no such part.
    A last hop needs the head (--ring) and a first hop that is a member; a first hop starts at block 0."""
    if meta.get("push") is not True:
        return None, None
    route = validate_route(meta.get("ring_to")) or None
    if route is not None and (guesser is None or end != guesser.num_blocks or not may_push_to(route[0][0])):
        route = None
    ring_from = meta.get("ring_from")
    if not (isinstance(ring_from, str) and 0 < len(ring_from) <= MAX_PEER_ID and start == 0 and may_push_here(ring_from)):
        ring_from = None
    return route, ring_from


def takes_guess(session: Session, pusher: str, step_id: int) -> bool:
    """Whether a first hop applies a guessed step now: its session takes this server's guesses, the guess is of the
    next step, and the client's own copy of the step before came (the ring is never more than a step ahead)."""
    last = session.last_step
    return (session.ring_from == pusher and step_id == session.applied
            and (last is None or last.unconfirmed is None))


def confirm_guess(session: Session, applied: AppliedStep, tensors: list[torch.Tensor], meta: dict[str, Any]) -> bool:
    """The client's own copy of a step came after its guess was applied: whether it confirms the guess (the same
    input). Any other copy ends the ring for the session (the client replays it elsewhere: its audit finds the guessed
    input in the answer it got)."""
    if applied.unconfirmed is None:
        return False
    try:
        digest = input_digest(tensors[0], tensors[1], tensors[2], meta.get("keep_rows"), applied.step_id)
    except (IndexError, TypeError, ValueError, AttributeError, RuntimeError):
        digest = None
    if digest == applied.unconfirmed:
        applied.unconfirmed = None
        return True
    session.ring_from = None
    return False
