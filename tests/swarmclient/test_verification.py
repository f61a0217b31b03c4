"""Checked outputs, the policy: sampling, tolerances, the majority rule, a hop's input history, permanent bans."""
from __future__ import annotations

import pytest
import torch

from swarmclient.config import ClientConfig
from swarmclient.hop_verifier import MAX_FORWARD_BYTES, HopCheck, row_chunks, unpadded_start
from swarmclient.retry import BanList
from swarmclient.verification_policy import (
    TOLERANCES,
    Verdict,
    VerificationCounts,
    VerificationTally,
    comparable,
    judge,
    max_difference,
    relative_error,
    sampled,
    stack_history,
    tolerance,
    verifier_order,
)
from swarmnet.data_structures import RemoteSpanInfo, RouteHop, ServerInfo, ServerState


def info(dtype: str = "float32", quant: str = "none", *, max_batch_size: int = 64, max_length: int = 2048) -> ServerInfo:
    return ServerInfo(state=ServerState.ONLINE, start=0, end=6, throughput=1.0, cache_tokens_left=100, dtype=dtype,
                      quant=quant, version="v", revision="r", max_batch_size=max_batch_size, max_length=max_length)


# ---- sampling -----------------------------------------------------------------------------------------------------
def test_sampling_is_reproducible_for_a_session_and_takes_about_the_fraction() -> None:
    picks = [sampled(0.1, "session-a", step, 0) for step in range(20000)]
    assert picks == [sampled(0.1, "session-a", step, 0) for step in range(20000)]
    assert 0.09 < sum(picks) / len(picks) < 0.11
    # another session, or another hop of the same steps, samples other steps
    assert picks != [sampled(0.1, "session-b", step, 0) for step in range(20000)]
    assert picks != [sampled(0.1, "session-a", step, 3) for step in range(20000)]


def test_a_fraction_of_one_checks_every_step_and_zero_none() -> None:
    assert all(sampled(1.0, "k", step, 0) for step in range(1000))
    assert not any(sampled(0.0, "k", step, 0) for step in range(1000))


def test_the_verifier_changes_with_the_step_so_every_holder_checks_and_is_checked() -> None:
    peers = ["peer-a", "peer-b", "peer-c"]
    firsts = [verifier_order(peers, "k", step, 0)[0] for step in range(60)]
    assert set(firsts) == set(peers)
    assert sorted(verifier_order(peers, "k", 7, 0)) == peers
    assert verifier_order(peers, "k", 7, 0) == verifier_order(list(reversed(peers)), "k", 7, 0)


def test_a_client_config_refuses_a_fraction_outside_zero_to_one() -> None:
    with pytest.raises(ValueError, match="verify_fraction"):
        ClientConfig(verify_fraction=1.5)


# ---- tolerances -------------------------------------------------------------------------------------------------
def test_the_tolerance_is_the_looser_precisions_and_quantization_counts_over_dtype() -> None:
    assert tolerance(info(), info()) == TOLERANCES["float32"]
    assert tolerance(info(), info("bfloat16")) == TOLERANCES["bfloat16"]
    assert tolerance(info(quant="nf4"), info("bfloat16")) == max(TOLERANCES["nf4"], TOLERANCES["bfloat16"])
    assert tolerance(info("float8"), info()) == max(TOLERANCES.values())  # unknown: the loosest
    assert all(TOLERANCES["float32"] * 10 <= limit for name, limit in TOLERANCES.items() if name != "float32")


def test_only_servers_of_one_precision_check_each_other() -> None:
    # a float32 and an nf4 server differ by ~0.4 on SmolLM2 (bench/verify_tolerance.py): too much to tell a lie
    assert comparable(info(), info()) and comparable(info("bfloat16"), info("bfloat16"))
    assert not comparable(info(), info("bfloat16")) and not comparable(info(), info(quant="nf4"))
    assert not comparable(info(quant="int8"), info(quant="nf4"))


def test_the_relative_error_is_the_worst_real_tokens_and_ignores_padding() -> None:
    want = torch.ones(2, 3, 4)
    got = want.clone()
    got[0, 1] += 0.5            # a real token off by 0.5 in each of 4 values: ||0.5 * 1|| / ||1|| = 0.5
    got[1, 0] += 100.0          # a padding position: not compared
    real = torch.tensor([[1, 1, 1], [0, 1, 1]])
    assert relative_error(got, want, real) == pytest.approx(0.5)
    assert max_difference(got, want, real) == pytest.approx(0.5)
    assert relative_error(want, want, real) == 0.0


def test_a_nan_output_never_matches() -> None:
    want = torch.ones(1, 1, 4)
    assert relative_error(torch.full_like(want, float("nan")), want, torch.ones(1, 1)) == float("inf")


def test_float32_tolerance_separates_rounding_from_noise() -> None:
    torch.manual_seed(0)
    want = torch.randn(4, 8, 64) * 3
    rounded = want * (1 + 1e-6 * torch.randn_like(want))
    noisy = want + 0.05 * torch.randn_like(want)
    real = torch.ones(4, 8)
    assert relative_error(rounded, want, real) < TOLERANCES["float32"] < relative_error(noisy, want, real)


# ---- who lies ---------------------------------------------------------------------------------------------------
def test_agreement_keeps_the_checked_output() -> None:
    assert judge(True, None) is Verdict.AGREE


def test_without_a_third_holder_the_checked_server_is_treated_as_faulty() -> None:
    assert judge(False, None) is Verdict.CHECKED_FAULTY


def test_a_third_holder_decides_by_majority() -> None:
    assert judge(False, True) is Verdict.SECOND_FAULTY     # checked + third against the second
    assert judge(False, False) is Verdict.CHECKED_FAULTY   # the third does not side with the checked server


# ---- a hop's whole input ----------------------------------------------------------------------------------------
def test_the_history_of_a_hop_follows_rows_that_leave() -> None:
    # three rows prefill 2 tokens, decode one, then row 1 leaves, then one more decode
    h0, p0 = torch.arange(3 * 2 * 1.0).view(3, 2, 1), torch.tensor([[0, 1], [0, 1], [0, 1]])
    h1, p1 = torch.full((3, 1, 1), 10.0), torch.full((3, 1), 2)
    h2, p2 = torch.full((2, 1, 1), 20.0), torch.full((2, 1), 3)
    hidden, positions = stack_history([(h0, p0, None), (h1, p1, None), (h2, p2, (0, 2))])
    assert hidden.shape == (2, 4, 1) and positions.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert hidden[:, :, 0].tolist() == [[0.0, 1.0, 10.0, 20.0], [4.0, 5.0, 10.0, 20.0]]


def test_a_history_is_sent_in_row_chunks_that_fit_one_call() -> None:
    hop = RouteHop("peer", 0, 6)
    length, hidden = 600, 576
    check = HopCheck(hop, torch.zeros(10, length, hidden), torch.ones(10, length), torch.zeros(10, length),
                     torch.zeros(10, 1, hidden))
    chunks = row_chunks(check, RemoteSpanInfo("other", 0, 6, info()))
    assert chunks is not None
    per_call = MAX_FORWARD_BYTES // (length * (hidden * 4 + 16))
    assert [c.stop - c.start for c in chunks][0] == per_call and chunks[-1].stop == 10
    assert row_chunks(check, RemoteSpanInfo("other", 0, 6, info(max_batch_size=1))) == [slice(i, i + 1) for i in range(10)]
    # a server that holds shorter sessions, or a row too long for one call: nobody can check it there
    assert row_chunks(check, RemoteSpanInfo("other", 0, 6, info(max_length=100))) is None
    huge = HopCheck(hop, torch.zeros(1, 2000, hidden), torch.ones(1, 2000), torch.zeros(1, 2000), torch.zeros(1, 1, hidden))
    assert row_chunks(huge, RemoteSpanInfo("other", 0, 6, info())) is None


def test_a_check_leaves_out_the_leading_padding_no_row_attends_to() -> None:
    # two rows: row 0 has 3 pad columns, row 1 has 5 (a shorter prompt); one hole mid-history; a 2-token window
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3], mask[1, :5], mask[:, 7] = 0, 0, 0
    assert unpadded_start(mask, 2) == 3       # only the columns masked in every row, and only a leading run
    assert unpadded_start(mask[1:], 2) == 5   # a chunk of row 1 alone drops its own padding
    # a history of nothing but padding keeps the compared window itself
    assert unpadded_start(torch.zeros(1, 6, dtype=torch.long), 2) == 4
    hop, hidden = RouteHop("peer", 0, 6), torch.arange(2 * 12 * 1.0).view(2, 12, 1)
    check = HopCheck(hop, hidden, mask, torch.arange(12).repeat(2, 1), torch.zeros(2, 2, 1)).unpadded()
    assert check.hidden.shape == (2, 9, 1) and check.mask[:, 4].tolist() == [0, 0]  # the hole stays: distances kept
    assert check.positions[0].tolist() == list(range(3, 12)) and torch.equal(check.real, mask[:, -2:])


# ---- counts and bans --------------------------------------------------------------------------------------------
def test_a_tally_adds_and_differences_give_what_is_not_stored_yet() -> None:
    tally = VerificationTally()
    tally.add(verified=3)
    stored = tally.snapshot()
    tally.add(verified=2, mismatches=1, unverified=4)
    assert tally.snapshot() - stored == VerificationCounts(2, 1, 4)
    assert not VerificationCounts() and VerificationCounts(unverified=1)


def test_a_server_banned_for_good_stays_banned_whatever_happens() -> None:
    now = [1000.0]
    bans = BanList(10.0, 100.0, clock=lambda: now[0])
    bans.ban_for_good("liar")
    bans.forgive("liar")
    bans.ban("liar")
    now[0] += 10_000
    assert bans.is_banned("liar") and bans.banned_for_good("liar") and bans.banned() == {"liar"}
    assert not bans.banned_for_good("other")
