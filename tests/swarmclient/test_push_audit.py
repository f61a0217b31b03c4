"""Push audit, the policy: a hop's claimed input against the client's record, with real RSA peer keys (no network)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarmclient.push_audit import Blame, InputClaim, InputRecord, judge_input
from swarmnet.identity import Identity
from swarmnet.push_proof import input_digest, proof_signer, sign_push

OWNER, UPSTREAM_SESSION, TARGET_SESSION, STEP = "QmClient", "up-session", "down-session", 7


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Identity]:
    folder = tmp_path_factory.mktemp("keys")
    return {name: Identity.create(Path(folder) / name) for name in ("upstream", "hop", "earlier")}


def step_input(noise: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = torch.arange(2 * 3 * 8, dtype=torch.float32).reshape(2, 3, 8) / 10 + noise
    return hidden, torch.ones(2, 5, dtype=torch.long), torch.arange(2, 5).expand(2, 3).contiguous()


def record(keys: dict[str, Identity], **changes: object) -> InputRecord:
    fields: dict[str, object] = dict(expected=input_digest(*step_input(), None, STEP), owner=OWNER,
                                     session_id=TARGET_SESSION, step_id=STEP,
                                     upstream=(keys["upstream"].peer_id, UPSTREAM_SESSION), sent=(), opened={})
    fields.update(changes)
    return InputRecord(**fields)  # type: ignore[arg-type]


def pushed(identity: Identity, digest: bytes, *, session: str = UPSTREAM_SESSION, step: int = STEP,
           target: str = TARGET_SESSION) -> InputClaim:
    return InputClaim(digest, sign_push(identity, owner=OWNER, upstream_session=session, target_session=target,
                                        step_id=step, digest=digest))


def test_the_digest_covers_the_hidden_states_their_dtype_the_mask_positions_rows_and_step() -> None:
    hidden, mask, positions = step_input()
    base = input_digest(hidden, mask, positions, None, STEP)
    assert base == input_digest(hidden.clone(), mask.int(), positions, None, STEP)  # masks compare as int64
    hidden_changed = hidden.clone()
    hidden_changed[1, 2, 3] += 1e-6
    mask_changed = mask.clone()
    mask_changed[0, 0] = 0
    variants = [input_digest(hidden_changed, mask, positions, None, STEP),
                input_digest(hidden.half(), mask, positions, None, STEP),
                input_digest(hidden, mask_changed, positions, None, STEP),
                input_digest(hidden, mask, positions + 1, None, STEP),
                input_digest(hidden, mask, positions, [0, 1], STEP),
                input_digest(hidden, mask, positions, None, STEP + 1)]
    assert len({base, *variants}) == len(variants) + 1


def test_an_answer_computed_on_the_recorded_input_blames_nobody(keys: dict[str, Identity]) -> None:
    expected = input_digest(*step_input(), None, STEP)
    assert judge_input(pushed(keys["upstream"], expected), record(keys)) is Blame.NONE
    assert judge_input(InputClaim(expected, None), record(keys)) is Blame.NONE


def test_an_upstream_that_signed_a_push_other_than_its_answer_is_the_liar(keys: dict[str, Identity]) -> None:
    noisy = input_digest(*step_input(0.1), None, STEP)
    assert judge_input(pushed(keys["upstream"], noisy), record(keys)) is Blame.UPSTREAM


@pytest.mark.parametrize("claim", [
    "no proof", "not bytes", "signed by the hop itself", "another step's proof", "another session's proof",
    "a proof of another digest"])
def test_a_hop_that_cannot_prove_its_input_is_the_liar(keys: dict[str, Identity], claim: str) -> None:
    noisy = input_digest(*step_input(0.1), None, STEP)
    claims = {
        "no proof": InputClaim(noisy, None),
        "not bytes": InputClaim("abc", None),
        "signed by the hop itself": pushed(keys["hop"], noisy),
        "another step's proof": pushed(keys["upstream"], noisy, step=STEP - 1),
        "another session's proof": pushed(keys["upstream"], noisy, target="another-down-session"),
        "a proof of another digest": InputClaim(noisy, pushed(keys["upstream"],
                                                              input_digest(*step_input(0.2), None, STEP)).proof),
    }
    assert judge_input(claims[claim], record(keys)) is Blame.HOP


def test_an_input_from_an_earlier_attempt_is_stale_and_blames_nobody(keys: dict[str, Identity]) -> None:
    earlier = input_digest(*step_input(1e-3), None, STEP)
    # the client sent it that input itself before the hop before was replaced
    assert judge_input(InputClaim(earlier, None), record(keys, sent={earlier})) is Blame.STALE
    # or a server the client routed through earlier pushed it, from a session the client opened there
    claim = pushed(keys["earlier"], earlier, session="earlier-session")
    assert judge_input(claim, record(keys, opened={"earlier-session": keys["earlier"].peer_id})) is Blame.STALE
    # but a session the client never opened, or opened at another server, proves nothing
    assert judge_input(claim, record(keys)) is Blame.HOP
    assert judge_input(claim, record(keys, opened={"earlier-session": keys["hop"].peer_id})) is Blame.HOP


def test_a_proof_is_refused_for_any_other_owner_session_step_or_digest(keys: dict[str, Identity]) -> None:
    digest = input_digest(*step_input(), None, STEP)
    proof = pushed(keys["upstream"], digest).proof
    signer = proof_signer(proof, owner=OWNER, target_session=TARGET_SESSION, step_id=STEP, digest=digest)
    assert signer is not None and signer.peer_id == keys["upstream"].peer_id
    assert signer.upstream_session == UPSTREAM_SESSION
    for changed in ({"owner": "QmOther"}, {"target_session": "x"}, {"step_id": STEP + 1}, {"digest": b"0" * 16}):
        args = dict(owner=OWNER, target_session=TARGET_SESSION, step_id=STEP, digest=digest) | changed
        assert proof_signer(proof, **args) is None  # type: ignore[arg-type]
    assert proof_signer({"session_id": 1}, owner=OWNER, target_session=TARGET_SESSION, step_id=STEP,
                        digest=digest) is None
