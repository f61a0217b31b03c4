"""Checked outputs against a server that really lies (SWARMBATCH_FAULT_INJECTION): real processes, the tiny model.

The lying server adds Gaussian noise to every output of its span. Unchecked, it corrupts the generation; with
every step checked (verify fraction 1.0, so the test does not depend on sampling luck) it is caught, banned for
the rest of the process, its hop replayed through honest servers, and the tokens equal transformers' generate.
"""
from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import cli
from jobs.assembly import set_runtime
from jobs.models import Job, Request
from jobs.runtime import Runtime
from jobs.settings import get_settings
from jobs.submission import submit_batch
from jobs.worker.job_worker import JobWorker
from launch.local_swarm import LocalSwarm
from launch.ready import SERVING_BLOCKS
from servers.faults import FAULT_INJECTION_ENV
from swarmclient.config import ClientConfig
from swarmclient.deferred_checks import DeferredChecks
from swarmclient.errors import LieCaught
from swarmclient.generation import generate_tokens
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.session import InferenceSession
from swarmclient.textgen import load_tokenizer
from swarmclient.verification_policy import VerificationTally, verifier_order

LIAR = {FAULT_INJECTION_ENV: "noise:0.1"}  # relative error ~1.4 on the tiny model's outputs; float32 allows 1e-3
PROMPTS = ["Hello world, this is", "The quick brown fox jumps over the lazy dog and then", "one two three"]
NEW_TOKENS = 24


def reference_tokens(model_dir: Path, batch: dict, max_new_tokens: int) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    return out[:, batch["input_ids"].shape[1]:]


def generate(model_dir: Path, swarm: LocalSwarm, batch: dict, fraction: float
             ) -> tuple[torch.Tensor, VerificationTally, set[str]]:
    """(new tokens, the checks' counts, the servers banned for good) of one greedy generation by a new client."""
    tally = VerificationTally()
    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                     config=ClientConfig(verify_fraction=fraction)) as model:
        params = model.sampling_params(batch["input_ids"].shape[0], False, 1.0, 1.0, 0)
        tokens = model.generate_new_tokens(batch["input_ids"], batch["attention_mask"], max_new_tokens=NEW_TOKENS,
                                           params=params, verification=tally)
        banned = {peer for peer in (s.peer_id for s in swarm.servers) if model.swarm.bans.banned_for_good(peer)}
    return tokens, tally, banned


def test_a_lying_server_corrupts_unchecked_output_and_checked_steps_catch_it(
        tiny_model: Path, local_swarm: Callable[..., LocalSwarm], caplog: pytest.LogCaptureFixture) -> None:
    # Given a swarm where a lying server is the only holder of blocks 0:3
    swarm = local_swarm(tiny_model, [])
    liar = swarm.start_server(0, 3, env=LIAR)
    swarm.start_server(3, 6)
    assert "TEST-ONLY FAULT INJECTION IS ON" in liar.log_path.read_text()
    batch = dict(load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True))
    expected = reference_tokens(tiny_model, batch, NEW_TOKENS)
    # When generating without checks, it corrupts the output
    unchecked, tally, _ = generate(tiny_model, swarm, batch, 0.0)
    assert not torch.equal(unchecked, expected)
    assert not tally.snapshot()
    # and with every step checked but no second holder of 0:3 or 3:6, nothing can be checked: counted, not caught
    alone, tally, banned = generate(tiny_model, swarm, batch, 1.0)
    assert not torch.equal(alone, expected) and not banned
    assert tally.snapshot().verified == 0 and tally.snapshot().unverified >= 2 * NEW_TOKENS
    # When two honest holders of 0:3 join and every step is checked
    swarm.start_servers([(0, 3, ()), (0, 3, ())])
    with caplog.at_level(logging.WARNING, logger="swarmclient"):
        checked, tally, banned = generate(tiny_model, swarm, batch, 1.0)
    # Then the tokens equal transformers' generate, the liar is banned for good and the mismatch is counted
    assert torch.equal(checked, expected)
    assert banned == {liar.peer_id}
    counts = tally.snapshot()
    assert counts.mismatches >= 1 and counts.verified > counts.mismatches
    assert counts.unverified >= NEW_TOKENS  # blocks 3:6 still have a single holder
    # and one warning line names the liar and the server it was compared with, with the difference
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Outputs differ on blocks 0:3")]
    assert len(lines) == counts.mismatches
    assert liar.peer_id in lines[0] and re.search(r"max difference \d", lines[0])
    assert re.search(rf"server {liar.peer_id} is banned for the rest of this process$", lines[0])


def test_a_server_banned_for_good_leaves_a_running_session_at_its_next_step_with_identical_tokens(
        tiny_model: Path, local_swarm: Callable[..., LocalSwarm]) -> None:
    # Given two honest holders of blocks 0:3 and a generation under way through one of them
    swarm = local_swarm(tiny_model, [(0, 3), (0, 3), (3, 6)])
    batch = dict(load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True))
    expected = reference_tokens(tiny_model, batch, NEW_TOKENS)
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers) as model:
        session = model.inference_session(batch_size=len(PROMPTS), max_length=batch["input_ids"].shape[1] + NEW_TOKENS)
        banned: list[str] = []

        def on_token(index: int, _: torch.Tensor) -> None:
            if index == 8:  # When another session of this process catches the first hop's server lying
                banned.append(session.route[0].peer_id)
                model.swarm.bans.ban_for_good(banned[0])

        with session:
            got = generate_tokens(model.head, session.step, batch["input_ids"], batch["attention_mask"],
                                  max_new_tokens=NEW_TOKENS, params=model.sampling_params(len(PROMPTS), False, 1.0, 1.0, 0),
                                  eos_token_ids=model.eos_token_ids, pad_token_id=model.pad_token_id, on_token=on_token)
            route = session.route
    # Then this session leaves that server at its next step (replayed elsewhere), and the tokens do not change
    assert banned and banned[0] not in {hop.peer_id for hop in route}
    assert session.failovers == 1
    assert torch.equal(got, expected)


def scrape(url: str) -> dict[str, float]:
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200
    return {sample.name: sample.value for family in text_string_to_metric_families(response.text)
            for sample in family.samples if not sample.labels}


def test_a_job_through_a_lying_server_completes_identical_and_counts_the_mismatch(
        tiny_model: Path, local_swarm: Callable[..., LocalSwarm], make_runtime: Callable[..., Runtime],
        serve: Callable[[Runtime], str], monkeypatch: pytest.MonkeyPatch) -> None:
    # Given three holders of blocks 0:3, one of them lying, and one holder of 3:6
    swarm = local_swarm(tiny_model, [])
    liar = swarm.start_server(0, 3, env=LIAR, wait=False)
    swarm.start_servers([(0, 3, ()), (0, 3, ()), (3, 6, ())])
    liar.wait_for_line(SERVING_BLOCKS, timeout=180)
    # and a job of greedy requests on a worker that checks every step (the worker's code path, in process)
    runtime = make_runtime(initial_peers=swarm.initial_peers, verify_fraction=1.0, worker_batch_size=4,
                           pipeline_lanes=2, checkpoint_every=4)
    # (each prompt twice, 16 tokens: 4 windows a lane, so the liar is in a route or asked to check, near surely)
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": prompt, "max_tokens": 16, "temperature": 0}})
             for i, prompt in enumerate(PROMPTS * 2)]
    job = submit_batch(runtime, ("\n".join(lines) + "\n").encode(), model=str(tiny_model))
    worker = JobWorker(runtime)
    while worker.process(job.id).more:
        pass
    # Then every request's tokens equal transformers' generate of its prompt
    with runtime.session() as session:
        requests = list(session.scalars(select(Request).where(Request.job_id == job.id).order_by(Request.index)))
        row = session.get(Job, job.id)
        assert row is not None and row.status == "completed"
        checks = (row.steps_verified, row.verification_mismatches, row.steps_unverified)
    for request in requests:
        prompt = torch.tensor([request.prompt_ids])
        expected = reference_tokens(tiny_model, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}, 16)
        assert request.generated_ids == expected[0].tolist()[:len(request.generated_ids)], request.custom_id
        assert len(request.generated_ids) == 16 or request.finish_reason == "stop"
    # and the liar was banned by the worker's swarm client, the mismatch counted on the job
    verified, mismatches, unverified = checks
    assert runtime.swarm_model(str(tiny_model)).swarm.bans.banned_for_good(liar.peer_id), \
        f"liar not banned: {verified} checks, {mismatches} mismatches, {unverified} unverified"
    assert mismatches >= 1 and verified > mismatches and unverified > 0
    # shown by `swarmbatch status JOB` (the CLI on the same embedded store) and in the API's job JSON
    monkeypatch.setenv("SWARMBATCH_HOME", str(runtime.settings.home))
    get_settings.cache_clear()
    set_runtime(None)
    try:
        status = CliRunner().invoke(cli.app, ["status", job.id])
        as_json = CliRunner().invoke(cli.app, ["status", job.id, "--json"])
    finally:
        get_settings.cache_clear()
        set_runtime(runtime)
    assert status.exit_code == 0, status.output
    assert f"{verified} steps verified ({mismatches} mismatch" in status.stdout
    assert json.loads(as_json.stdout)["verification"] == {"steps_verified": verified, "mismatches": mismatches,
                                                          "steps_unverified": unverified}
    # and in the API's /metrics
    metrics = scrape(serve(runtime))
    assert metrics["swarmbatch_verification_mismatches_total"] == mismatches
    assert metrics["swarmbatch_steps_verified_total"] == verified
    assert metrics["swarmbatch_steps_unverified_total"] == unverified


PUSH_LIAR = {FAULT_INJECTION_ENV: "push-noise:0.1"}  # answers its client honestly, pushes noise to the next server


def test_a_server_that_pushes_noise_while_answering_honestly_is_banned_and_the_next_one_never(
        tiny_model: Path, local_swarm: Callable[..., LocalSwarm], caplog: pytest.LogCaptureFixture) -> None:
    # Given a liar holding blocks 0:3 that answers honestly but pushes noise on, and two honest holders of 3:6 (so
    # that a check of 3:6 could ban the one computing on the noise, as it did before push proofs)
    swarm = local_swarm(tiny_model, [])
    liar = swarm.start_server(0, 3, env=PUSH_LIAR, wait=False)
    following = swarm.start_servers([(3, 6, ()), (3, 6, ())])
    liar.wait_for_line(SERVING_BLOCKS, timeout=180)
    assert "pushes (its answers stay honest)" in liar.log_path.read_text()
    batch = dict(load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True))
    expected = reference_tokens(tiny_model, batch, NEW_TOKENS)
    config = ClientConfig(verify_fraction=1.0, push=True, discovery_ttl=0.2)
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers,
                                                     config=config) as model:
        session = model.inference_session(batch_size=len(PROMPTS), max_length=batch["input_ids"].shape[1] + NEW_TOKENS)
        with session:
            assert session.route[0].peer_id == liar.peer_id  # the only holder of 0:3 when the session opened
            # When an honest holder of 0:3 joins and every step goes through the liar first, checked
            honest = swarm.start_server(0, 3)
            with caplog.at_level(logging.WARNING, logger="swarmclient"):
                got = generate_tokens(model.head, session.step, batch["input_ids"], batch["attention_mask"],
                                      max_new_tokens=NEW_TOKENS,
                                      params=model.sampling_params(len(PROMPTS), False, 1.0, 1.0, 0),
                                      eos_token_ids=model.eos_token_ids, pad_token_id=model.pad_token_id)
            route = session.route
        banned = {peer for peer in (s.peer_id for s in swarm.servers) if model.swarm.bans.banned_for_good(peer)}
    # Then the liar is banned for good at its first lie, nobody else, and the tokens equal transformers' generate
    assert banned == {liar.peer_id}
    assert route[0].peer_id == honest.peer_id and route[1].peer_id in {s.peer_id for s in following}
    assert torch.equal(got, expected)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Server on blocks")]
    assert len(lines) == 1 and f"0:3, {liar.peer_id}, pushed to the next server other outputs" in lines[0]
    assert not [r for r in caplog.records if r.getMessage().startswith("Outputs differ")]


def test_an_honest_swarm_with_push_and_every_step_checked_bans_nobody(
        tiny_model: Path, local_swarm: Callable[..., LocalSwarm], caplog: pytest.LogCaptureFixture) -> None:
    # Given two honest holders of each half of the model
    swarm = local_swarm(tiny_model, [(0, 3), (0, 3), (3, 6), (3, 6)])
    batch = dict(load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True))
    # When a client generates with push on and every step checked
    with caplog.at_level(logging.INFO, logger="swarmclient"):
        got, tally, banned = generate(tiny_model, swarm, batch, 1.0)
    # Then nobody is banned or replayed, every hop step was checked and agreed, and the tokens are transformers'
    assert not banned
    assert tally.snapshot().mismatches == 0 and tally.snapshot().verified >= 2 * NEW_TOKENS
    assert not [r for r in caplog.records if "earlier input" in r.getMessage() or "banned" in r.getMessage()]
    assert torch.equal(got, reference_tokens(tiny_model, batch, NEW_TOKENS))


def test_deferred_checks_let_the_session_go_on_then_void_it_and_the_retry_is_identical(
        tiny_model: Path, local_swarm: Callable[..., LocalSwarm]) -> None:
    # Given a session opened while a lying server was the only holder of blocks 0:3
    swarm = local_swarm(tiny_model, [])
    liar = swarm.start_server(0, 3, env=LIAR)
    swarm.start_server(3, 6)
    batch = dict(load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True))
    expected = reference_tokens(tiny_model, batch, NEW_TOKENS)
    config = ClientConfig(verify_fraction=1.0, discovery_ttl=0.2)
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers,
                                                     config=config) as model:
        params = model.sampling_params(len(PROMPTS), False, 1.0, 1.0, 0)
        length = batch["input_ids"].shape[1] + NEW_TOKENS
        session = model.inference_session(batch_size=len(PROMPTS), max_length=length,
                                          deferred=DeferredChecks(model.swarm.loop))
        seen: list[torch.Tensor] = []
        with pytest.raises(LieCaught) as caught:
            with session:
                assert session.route[0].peer_id == liar.peer_id
                # and two honest holders of 0:3 joining after it (so every step of the liar can be checked)
                swarm.start_servers([(0, 3, ()), (0, 3, ())])
                # When it generates with deferred checks of every step
                generate_tokens(model.head, session.step, batch["input_ids"], batch["attention_mask"],
                                max_new_tokens=NEW_TOKENS, params=params, eos_token_ids=model.eos_token_ids,
                                pad_token_id=model.pad_token_id, on_token=lambda _, column: seen.append(column))
        # Then the session went on with the liar's outputs before the lie was acted on (the steps did not wait for
        # their checks), and then it stopped with LieCaught naming the liar, banned for good
        assert seen and caught.value.peer_id == liar.peer_id
        assert not torch.equal(torch.stack(seen, dim=1), expected[:, :len(seen)])
        assert model.swarm.bans.banned_for_good(liar.peer_id)
        # and the retry (a new session of the same client, as a job's next attempt) routes around it: identical tokens
        tally = VerificationTally()
        again = model.generate_new_tokens(batch["input_ids"], batch["attention_mask"], max_new_tokens=NEW_TOKENS,
                                          params=params, verification=tally, deferred=DeferredChecks(model.swarm.loop))
    assert torch.equal(again, expected)
    assert tally.snapshot().verified > 0 and tally.snapshot().mismatches == 0


def test_a_checkpoint_where_no_other_server_holds_the_hops_blocks_does_not_wait_for_checks(
        tiny_model: Path, shared_swarm: LocalSwarm) -> None:
    # Given a swarm where each block has one holder (nobody can check anyone) and a client sampling every row
    tally = VerificationTally()
    batch = dict(load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True))
    closed: list[bool] = []
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=shared_swarm.initial_peers,
                                                     config=ClientConfig(verify_fraction=1.0)) as model:
        checks = DeferredChecks(model.swarm.loop)

        def checkpoint(index: int, _: torch.Tensor) -> None:
            if (index + 1) % 4 == 0:  # a job's checkpoint every 4 tokens
                closed.append(checks.close_window())
        # When it generates with window checks, closing a window every 4 tokens
        got = model.generate_new_tokens(batch["input_ids"], batch["attention_mask"], max_new_tokens=12,
                                        params=model.sampling_params(len(PROMPTS), False, 1.0, 1.0, 0),
                                        verification=tally, deferred=checks, on_token=checkpoint)
    # Then every checkpoint found its window settled (its tokens can be committed at once: a crash redoes one window),
    # each hop's sampled rows were counted unverified, and the tokens are transformers'
    assert closed == [True, True, True]
    counts = tally.snapshot()
    assert (counts.verified, counts.mismatches) == (0, 0) and counts.unverified >= 2 * len(closed)
    assert torch.equal(got, reference_tokens(tiny_model, batch, 12))


def test_window_checks_compare_each_leaving_row_when_it_leaves_and_the_rest_at_the_settle(
        tiny_model: Path, local_swarm: Callable[..., LocalSwarm]) -> None:
    # Given two honest holders of each half, and three rows that stop after 4, 8 and 12 tokens (finished rows leave)
    swarm = local_swarm(tiny_model, [(0, 3), (0, 3), (3, 6), (3, 6)])
    batch = dict(load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True))
    expected = reference_tokens(tiny_model, batch, 12)
    limits = [4, 8, 12]
    tally = VerificationTally()
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers,
                                                     config=ClientConfig(verify_fraction=1.0)) as model:
        # When the rows are generated in one window with every row sampled
        got = model.generate_new_tokens(batch["input_ids"], batch["attention_mask"], max_new_tokens=limits,
                                        params=model.sampling_params(len(PROMPTS), False, 1.0, 1.0, 0), shrink=True,
                                        verification=tally, deferred=DeferredChecks(model.swarm.loop))
    # Then each row's tokens are transformers' up to its limit
    for row, limit in enumerate(limits):
        assert got[row, :limit].tolist() == expected[row, :limit].tolist()
    # and each hop was checked once for each row leaving (rows 0 and 1, at different steps) and once at the settle
    # (row 2): 3 checks x 2 hops, each over the positions of its window, all agreeing
    counts = tally.snapshot()
    assert (counts.verified, counts.mismatches, counts.unverified) == (6, 0, 0)


def test_a_window_check_after_a_failover_compares_only_the_new_servers_outputs(
        tiny_model: Path, local_swarm: Callable[..., LocalSwarm]) -> None:
    # Given a session through a lying server on blocks 0:3, with two honest holders joining after it opened
    swarm = local_swarm(tiny_model, [])
    liar = swarm.start_server(0, 3, env=LIAR)
    swarm.start_server(3, 6)
    batch = dict(load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True))
    config = ClientConfig(verify_fraction=1.0, discovery_ttl=0.2)
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers,
                                                     config=config) as model:
        tally = VerificationTally()
        session = model.inference_session(batch_size=len(PROMPTS), max_length=batch["input_ids"].shape[1] + NEW_TOKENS,
                                          verification=tally, deferred=DeferredChecks(model.swarm.loop))

        def on_token(index: int, _: torch.Tensor) -> None:
            if index == 4:  # When the liar dies in the middle of the window (before any check of it ran)
                liar.kill()

        with session:
            assert session.route[0].peer_id == liar.peer_id
            swarm.start_servers([(0, 3, ()), (0, 3, ())])
            generate_tokens(model.head, session.step, batch["input_ids"], batch["attention_mask"],
                            max_new_tokens=NEW_TOKENS, params=model.sampling_params(len(PROMPTS), False, 1.0, 1.0, 0),
                            eos_token_ids=model.eos_token_ids, pad_token_id=model.pad_token_id, on_token=on_token)
            route = session.route
        # Then the session failed over, and its window check compared the new server's outputs with a recompute,
        # not the dead liar's outputs recorded before the failover: no honest server is blamed, no lie is reported
        assert session.failovers == 1 and route[0].peer_id != liar.peer_id
        banned = {s.peer_id for s in swarm.servers if model.swarm.bans.banned_for_good(s.peer_id)}
    assert banned == set()
    counts = tally.snapshot()
    assert counts.verified >= 1 and counts.mismatches == 0


def generate_with_checkpoints(model: DistributedModelForCausalLM, session: InferenceSession, batch: dict,
                              checks: DeferredChecks, every: int, tokens: int,
                              on_token: Callable[[int], None] = lambda index: None) -> torch.Tensor:
    """Greedy tokens through the open `session`, closing a check window every `every` tokens, as a job's lane does."""
    def checkpoint(index: int, _: torch.Tensor) -> None:
        on_token(index)
        if (index + 1) % every == 0 and index + 1 < tokens:
            checks.close_window()
    return generate_tokens(model.head, session.step, batch["input_ids"], batch["attention_mask"],
                           max_new_tokens=tokens, params=model.sampling_params(len(PROMPTS), False, 1.0, 1.0, 0),
                           eos_token_ids=(), pad_token_id=model.pad_token_id, on_token=checkpoint)


def window_checked_session(model: DistributedModelForCausalLM, batch: dict, tally: VerificationTally
                           ) -> tuple[InferenceSession, DeferredChecks]:
    """A session of the batch's rows, 12 tokens long, whose checks run by window as a job lane's do."""
    checks = DeferredChecks(model.swarm.loop)
    return InferenceSession(model.swarm, batch_size=len(PROMPTS), max_length=batch["input_ids"].shape[1] + 12,
                            verification=tally, deferred=checks), checks


def test_window_checks_begun_when_their_window_opens_are_answered_by_the_holder_fed_meanwhile(
        tiny_model: Path, local_swarm: Callable[..., LocalSwarm]) -> None:
    # Given two honest holders of each half and a client sampling every row, closing a window every 4 tokens
    swarm = local_swarm(tiny_model, [(0, 3), (0, 3), (3, 6), (3, 6)])
    batch = dict(load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True))
    tally = VerificationTally()
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers,
                                                     config=ClientConfig(verify_fraction=1.0)) as model:
        session, checks = window_checked_session(model, batch, tally)
        # When it generates 12 tokens: windows of steps [0, 4), [4, 8) and [8, 12)
        with session:
            got = generate_with_checkpoints(model, session, batch, checks, 4, 12)
    # Then the tokens are transformers', each window of each hop was checked and agreed, and the checks of the two
    # windows that opened after the first were answered by the warm holder (fed the history while their steps ran)
    assert torch.equal(got, reference_tokens(tiny_model, batch, 12))
    counts = tally.snapshot()
    assert (counts.verified, counts.mismatches, counts.unverified, counts.warm) == (6, 0, 0, 4)


def test_a_warm_check_whose_holder_lies_bans_that_holder_by_the_third_and_the_tokens_stay_right(
        tiny_model: Path, local_swarm: Callable[..., LocalSwarm]) -> None:
    # Given a session through an honest server of blocks 0:3, then a lying and an honest holder of 0:3 joining
    swarm = local_swarm(tiny_model, [(0, 3), (3, 6)])
    honest = swarm.servers[0]
    batch = dict(load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True))
    tally = VerificationTally()
    with two_late_holders(tiny_model, swarm, batch, tally, LIAR) as (model, session, checks, (liar, other)):
        assert session.route[0].peer_id == honest.peer_id
        # and a key of the session's checks (what they draw from) that asks the honest one to check window [0, 4),
        # the liar to check [4, 8) (a warm check: begun when that window opened), and the honest one for [8, 12)
        session._verifier.key = key_asking(liar.peer_id, other.peer_id, [other.peer_id, liar.peer_id, other.peer_id])
        # When it generates 12 tokens, closing a window every 4 (and the last window's checks settle at its end)
        got = generate_with_checkpoints(model, session, batch, checks, 4, 12)
        assert session.route[0].peer_id == honest.peer_id
    banned = {s.peer_id for s in swarm.servers if model.swarm.bans.banned_for_good(s.peer_id)}
    # Then the liar's warm answer differed, the third holder sided with the checked server, and the liar alone is
    # banned; the session went on through the honest server: transformers' tokens
    assert banned == {liar.peer_id}
    counts = tally.snapshot()
    assert (counts.verified, counts.mismatches, counts.unverified, counts.warm) == (3, 1, 3, 2)
    assert torch.equal(got, reference_tokens(tiny_model, batch, 12))


def test_a_warm_check_goes_on_without_a_sampled_row_that_finished_within_its_window(
        tiny_model: Path, local_swarm: Callable[..., LocalSwarm]) -> None:
    # Given two honest holders of each half, a client sampling every row and closing a window every 4 tokens, and
    # three rows of which the first stops after 6 tokens (within the window [4, 8)) and leaves the session
    swarm = local_swarm(tiny_model, [(0, 3), (0, 3), (3, 6), (3, 6)])
    batch = dict(load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True))
    limits = [6, 12, 12]
    tally = VerificationTally()
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers,
                                                     config=ClientConfig(verify_fraction=1.0)) as model:
        session, checks = window_checked_session(model, batch, tally)

        def checkpoint(index: int, _: torch.Tensor) -> None:
            if index in (3, 7):
                checks.close_window()
        # When it generates, finished rows leaving the session
        with session:
            got = generate_tokens(model.head, session.step, batch["input_ids"], batch["attention_mask"],
                                  max_new_tokens=limits, params=model.sampling_params(len(PROMPTS), False, 1.0, 1.0, 0),
                                  eos_token_ids=(), pad_token_id=model.pad_token_id, on_token=checkpoint, shrink=True)
    # Then each row's tokens are transformers' up to its limit
    expected = reference_tokens(tiny_model, batch, 12)
    for row, limit in enumerate(limits):
        assert got[row, :limit].tolist() == expected[row, :limit].tolist()
    # and each hop was checked in the window [0, 4) (statelessly: nothing to begin before it), for the leaving row as
    # it left (statelessly), and warm for the other two rows at the ends of [4, 8) and [8, 12): all agreeing
    counts = tally.snapshot()
    assert (counts.verified, counts.mismatches, counts.unverified, counts.warm) == (8, 0, 0, 4)

def key_asking(first: str, second: str, order: list[str]) -> str:
    """A key of a session's checks under which each window (from steps 0, 4 and 8) asks the holder named in `order`
    first, of the holders `first` and `second` of blocks 0:3."""
    return next(key for key in (f"key-{i}" for i in range(1000))
                if [verifier_order([first, second], key, step, 0)[0] for step in (0, 4, 8)] == order)


def test_a_warm_check_whose_holder_dies_in_its_window_is_made_statelessly_by_the_next_holder(
        tiny_model: Path, local_swarm: Callable[..., LocalSwarm]) -> None:
    # Given a session through one server of blocks 0:3, and two more holders of 0:3 that can check it
    swarm = local_swarm(tiny_model, [(0, 3), (3, 6)])
    batch = dict(load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True))
    tally = VerificationTally()
    with two_late_holders(tiny_model, swarm, batch, tally, {}) as (model, session, checks, (doomed, kept)):
        # whose window [4, 8) check is warm on the one that dies during that window
        session._verifier.key = key_asking(doomed.peer_id, kept.peer_id, [kept.peer_id, doomed.peer_id, kept.peer_id])

        def kill_in_window(index: int) -> None:
            if index == 5:
                doomed.kill()
        got = generate_with_checkpoints(model, session, batch, checks, 4, 12, kill_in_window)
    banned = {s.peer_id for s in swarm.servers if model.swarm.bans.banned_for_good(s.peer_id)}
    # Then that window was still checked, by a stateless forward on the other holder, the next one warm; nobody is
    # banned for good, and the tokens are transformers'
    counts = tally.snapshot()
    assert (counts.verified, counts.mismatches, counts.unverified, counts.warm) == (3, 0, 3, 1)
    assert banned == set()
    assert torch.equal(got, reference_tokens(tiny_model, batch, 12))


@contextmanager
def two_late_holders(model_dir: Path, swarm: LocalSwarm, batch: dict, tally: VerificationTally, env: dict[str, str]
                     ) -> Iterator[tuple[DistributedModelForCausalLM, InferenceSession, DeferredChecks, tuple[Any, Any]]]:
    """A client sampling every row, a window-checked session opened through the swarm's servers, then two more holders
    of blocks 0:3 (the first with `env`), once the client sees them; the session settles its checks at the end."""
    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                     config=ClientConfig(verify_fraction=1.0, discovery_ttl=0.2)) as model:
        session, checks = window_checked_session(model, batch, tally)
        with session:
            holders = swarm.start_server(0, 3, env=env), swarm.start_server(0, 3)
            wait_for_holders(model, 3)
            yield model, session, checks, holders


def wait_for_holders(model: DistributedModelForCausalLM, count: int) -> None:
    """Until the client's view of the swarm shows `count` holders of blocks 0:3."""
    deadline = time.monotonic() + 30
    while len([s for s in model.swarm.loop.run(model.swarm.member_spans()) if s.start == 0]) < count:
        assert time.monotonic() < deadline, f"the client never saw {count} holders of blocks 0:3"
        time.sleep(0.2)
