"""The official `openai` SDK, unchanged but for its base_url, against swarmbatch: Files + Batch APIs.

Every object the SDK gets back is validated against the SDK's own pydantic models in strict mode (from the raw
JSON), so a missing or mistyped field fails here, not in a user's code. The fast tests serve the API in this
process (real uvicorn on 127.0.0.1, real store and Redis broker, no worker) and finish requests with the store's
own verbs as a worker would; the swarm test runs `swarmbatch api` and `swarmbatch worker` processes on a real
tiny-model swarm.
"""
from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pytest
import torch
from factories import new_key
from jobs_support import check_lines, requests_of, start_api
from openai import OpenAI
from openai.types import Batch, Completion, FileDeleted, FileObject, Model
from openai.types.batch_request_counts import BatchRequestCounts
from openai.types.chat import ChatCompletion
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select
from transformers import AutoModelForCausalLM

from jobs import files, store
from jobs.models import FileChunk, RequestStatus
from jobs.runtime import Runtime
from launch.local_swarm import LocalSwarm
from launch.local_worker import start_local_worker
from swarmclient.textgen import load_tokenizer

# the SDK's first request reads platform.uname().processor, which runs `uname -p` (a child process): read it here, at
# collection, so that the fast tier's tests do not start one
platform.uname().processor  # noqa: B018

PROMPTS = ["The city council voted", "Once upon a time", "Rain fell on the", "My favourite number is"]


def line(custom_id: str, prompt: str, model: str, *, url: str = "/v1/completions", **body: Any) -> dict[str, Any]:
    """One OpenAI batch request line."""
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, **body}}


def jsonl(lines: list[Any]) -> bytes:
    return "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines).encode() + b"\n"


def strict_batch(client: OpenAI, batch_id: str) -> Batch:
    """batches.retrieve, its raw JSON validated strictly by the SDK's Batch model."""
    raw = client.batches.with_raw_response.retrieve(batch_id)
    return Batch.model_validate_json(raw.text, strict=True)


def strict_file(client: OpenAI, file_id: str) -> FileObject:
    """files.retrieve, its raw JSON validated strictly by the SDK's FileObject model."""
    return FileObject.model_validate_json(client.files.with_raw_response.retrieve(file_id).text, strict=True)



@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime], redis_url: str, tiny_model: Path) -> Runtime:
    """SQLite store, real Redis broker; the API serves the tiny model (the lines' body.model), alias gpt-4o-mini."""
    return make_runtime(broker_url=redis_url, api_models=[str(tiny_model)], max_file_bytes=20_000,
                        model_aliases={"gpt-4o-mini": str(tiny_model)})


@pytest.fixture
def sdk(serve: Callable[[Runtime], str]) -> Iterator[Callable[[Runtime, str], OpenAI]]:
    """An `openai.OpenAI` client of the API serving a runtime, with a key; only base_url differs from OpenAI's."""
    made: list[OpenAI] = []

    def make(runtime: Runtime, key: str) -> OpenAI:
        made.append(OpenAI(base_url=f"{serve(runtime)}/v1", api_key=key, max_retries=0))
        return made[-1]

    yield make
    for client in made:
        client.close()


def upload_batch(client: OpenAI, lines: list[Any], name: str = "batch.jsonl") -> FileObject:
    created = client.files.with_raw_response.create(file=(name, jsonl(lines)), purpose="batch")
    return FileObject.model_validate_json(created.text, strict=True)


def create_batch(client: OpenAI, file_id: str, **options: Any) -> Batch:
    raw = client.batches.with_raw_response.create(input_file_id=file_id, endpoint="/v1/completions",
                                                  completion_window="24h", **options)
    return Batch.model_validate_json(raw.text, strict=True)


def test_the_sdk_uploads_a_file_and_creates_a_batch_from_it(runtime: Runtime, sdk: Callable[..., OpenAI],
                                                            tiny_model: Path) -> None:
    client = sdk(runtime, new_key(runtime))
    model = str(tiny_model)
    lines = [line("a", PROMPTS[0], model), "{broken", line("b", PROMPTS[1], model, tools=[{"type": "function"}]),
             line("c", PROMPTS[2], model, url="/v1/chat/completions"), line("d", PROMPTS[3], model)]

    # When a file is uploaded with purpose batch and a batch is created from it
    uploaded = upload_batch(client, lines)
    created = create_batch(client, uploaded.id, metadata={"team": "docs"})

    # Then the file is OpenAI's file object, and its content is what was uploaded
    assert uploaded.id.startswith("file-") and uploaded.purpose == "batch" and uploaded.filename == "batch.jsonl"
    assert uploaded.bytes == len(jsonl(lines)) and strict_file(client, uploaded.id) == uploaded
    assert client.files.content(uploaded.id).content == jsonl(lines)
    # and the batch is OpenAI's batch object, validating at once: its lines are not checked yet (nor its model read)
    assert (created.status, created.input_file_id, created.endpoint, created.completion_window) == (
        "validating", uploaded.id, "/v1/completions", "24h")
    assert created.request_counts is not None and created.request_counts.total == 0
    assert created.errors is None and created.model is None and created.metadata == {"team": "docs"}
    # When a worker has checked them, Then the batch has its requests, and the bad lines as errors naming line and param
    check_lines(runtime, created.id)
    batch = strict_batch(client, created.id)
    assert batch.status == "validating" and batch.metadata == {"team": "docs"} and batch.model == model
    assert batch.request_counts is not None and batch.request_counts.total == 2
    assert batch.output_file_id is None and batch.error_file_id is None and batch.expires_at is not None
    assert batch.errors is not None and [(e.line, e.code, e.param) for e in batch.errors.data or []] == [
        (2, "invalid_json", None), (3, "unsupported_parameter", "body.tools"), (4, "invalid_url", "url")]
    assert strict_batch(client, batch.id) == batch


def test_the_sdks_auto_paging_ends_and_yields_each_batch_and_file_once(runtime: Runtime, sdk: Callable[..., OpenAI],
                                                                       tiny_model: Path) -> None:
    # Given five batches (and five input files) of one key
    client = sdk(runtime, new_key(runtime))
    uploaded = [upload_batch(client, [line("a", PROMPTS[0], str(tiny_model))]) for _ in range(5)]
    made = [create_batch(client, f.id).id for f in uploaded]

    # When the SDK pages through them two at a time
    batches = [b.id for b in client.batches.list(limit=2)]
    files = [f.id for f in client.files.list(limit=2)]

    # Then it stops, with each once, newest first
    assert batches == made[::-1]
    assert files == [f.id for f in uploaded][::-1]
    first = client.batches.list(limit=2)
    assert first.has_more is True and [b.id for b in first.data] == made[:2:-1]


def test_another_key_gets_not_found_for_every_id_of_the_first(runtime: Runtime, sdk: Callable[..., OpenAI],
                                                               tiny_model: Path) -> None:
    owner, stranger = sdk(runtime, new_key(runtime, "owner")), sdk(runtime, new_key(runtime, "stranger"))
    uploaded = upload_batch(owner, [line("a", PROMPTS[0], str(tiny_model))])
    batch = create_batch(owner, uploaded.id)

    for call in (lambda: stranger.batches.retrieve(batch.id), lambda: stranger.batches.cancel(batch.id),
                 lambda: stranger.files.retrieve(uploaded.id), lambda: stranger.files.content(uploaded.id),
                 lambda: stranger.files.delete(uploaded.id), lambda: create_batch(stranger, uploaded.id)):
        with pytest.raises(openai.NotFoundError) as refused:
            call()
        assert "no job" in refused.value.message or "no file" in refused.value.message
    assert list(stranger.batches.list()) == [] and list(stranger.files.list()) == []
    assert strict_batch(owner, batch.id).status == "validating" and strict_file(owner, uploaded.id).id == uploaded.id


def test_the_sdks_exceptions_carry_our_message_and_the_parameter(runtime: Runtime, sdk: Callable[..., OpenAI],
                                                                 tiny_model: Path) -> None:
    client = sdk(runtime, new_key(runtime))
    good = upload_batch(client, [line("a", PROMPTS[0], str(tiny_model))])

    with pytest.raises(openai.BadRequestError) as purpose:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as endpoint:
        client.batches.create(input_file_id=good.id, endpoint="/v1/moderations", completion_window="24h")
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=("big.jsonl", b"x" * 20_001), purpose="batch")
    unserved = create_batch(client, upload_batch(client, [line("a", PROMPTS[0], "gpt-4o")]).id)

    assert purpose.value.param == "purpose" and "purpose must be 'batch'" in purpose.value.message
    assert endpoint.value.param == "endpoint" and "/v1/moderations" in endpoint.value.message
    assert too_large.value.status_code == 413 and "SWARMBATCH_MAX_FILE_BYTES" in too_large.value.message
    assert [f.filename for f in client.files.list(purpose="batch")] == ["batch.jsonl", "batch.jsonl"]
    # a model the lines name is read with them, after batches.create: as with OpenAI, the batch then fails, saying so
    check_lines(runtime, unserved.id)
    failed = strict_batch(client, unserved.id)
    assert failed.status == "failed" and failed.errors is not None and failed.errors.data is not None
    [error] = failed.errors.data
    assert (error.code, error.param, error.line) == ("model_not_found", "body.model", 1)
    assert error.message is not None and "'gpt-4o' is not served here" in error.message


def test_an_upload_of_several_chunks_is_stored_in_pieces_and_read_back_byte_for_byte(
        make_runtime: Callable[..., Runtime], redis_url: str, sdk: Callable[..., OpenAI]) -> None:
    runtime = make_runtime(broker_url=redis_url, max_file_bytes=3 * files.CHUNK_BYTES)
    client = sdk(runtime, new_key(runtime))
    data = bytes(range(256)) * (files.CHUNK_BYTES * 5 // 2 // 256)

    uploaded = client.files.create(file=("big.jsonl", data), purpose="batch")

    assert uploaded.bytes == len(data) and client.files.content(uploaded.id).content == data
    with runtime.session() as session:
        sizes = session.scalars(select(func.length(FileChunk.data)).where(FileChunk.file_id == uploaded.id)
                                .order_by(FileChunk.seq)).all()
    assert sizes == [files.CHUNK_BYTES, files.CHUNK_BYTES, len(data) - 2 * files.CHUNK_BYTES]


def test_the_sdk_lists_and_retrieves_the_models_and_their_aliases(runtime: Runtime, sdk: Callable[..., OpenAI],
                                                                 tiny_model: Path) -> None:
    client = sdk(runtime, new_key(runtime))
    listed = client.models.with_raw_response.list()
    models = [Model.model_validate(m, strict=True) for m in json.loads(listed.text)["data"]]
    assert [m.id for m in models] == [str(tiny_model), "gpt-4o-mini"] == [m.id for m in client.models.list()]
    raw = client.models.with_raw_response.retrieve("gpt-4o-mini")
    assert Model.model_validate_json(raw.text, strict=True) == models[1] and models[1].owned_by == "swarmbatch"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found" and "gpt-4o" in missing.value.message


def test_every_error_answer_has_openais_body(runtime: Runtime, serve: Callable[[Runtime], str]) -> None:
    url = serve(runtime)
    answers = [httpx.get(f"{url}/v1/nothing-here"), httpx.delete(f"{url}/v1/batches"),
               httpx.get(f"{url}/v1/files"), httpx.get(f"{url}/v1/files", headers={"Authorization": "Bearer x"})]
    assert [a.status_code for a in answers] == [404, 405, 401, 401]
    for answer in answers:
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], answer.text


def finish_first(runtime: Runtime, batch_id: str, tokens: list[int]) -> None:
    """As a worker would: check the batch's lines, claim the first request and complete it with these token ids."""
    check_lines(runtime, batch_id)
    with runtime.session() as session:
        token, [row, *_] = store.claim_requests(session=session, job_id=batch_id, worker="test", limit=1,
                                                lease_seconds=60, max_attempts=5)
        store.finish_request(session=session, request_id=row.id, token=token, status=RequestStatus.completed,
                             generated=tokens, finish_reason="length", output_text="partial out")
        session.commit()


def test_a_cancelled_batch_gets_partial_output_and_error_files_that_can_be_deleted(
        runtime: Runtime, sdk: Callable[..., OpenAI], tiny_model: Path) -> None:
    # Given a batch of three good lines and a bad one, whose first request completed
    client = sdk(runtime, new_key(runtime))
    lines = [line(c, PROMPTS[i], str(tiny_model)) for i, c in enumerate("abc")] + ["{broken"]
    batch = create_batch(client, upload_batch(client, lines).id)
    finish_first(runtime, batch.id, [5, 6, 7])

    # When it is cancelled
    cancelled = Batch.model_validate_json(client.batches.with_raw_response.cancel(batch.id).text, strict=True)

    # Then it ends cancelled with an output file of the finished request, in OpenAI's line shape
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    assert cancelled.cancelling_at is not None and cancelled.output_file_id and cancelled.error_file_id
    output = client.files.content(cancelled.output_file_id).text
    [result] = [json.loads(x) for x in output.splitlines()]
    assert result["custom_id"] == "a" and result["error"] is None and result["response"]["status_code"] == 200
    body = result["response"]["body"]
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "partial out"
    assert body["usage"]["completion_tokens"] == 3
    # and an error file of the bad line and the requests the cancel stopped
    errors = [json.loads(x) for x in client.files.content(cancelled.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        (None, "invalid_json"), ("b", "batch_cancelled"), ("c", "batch_cancelled")]
    # and both are files of the key, purpose batch_output, whose bytes are their content's length
    out_file = strict_file(client, cancelled.output_file_id)
    assert out_file.purpose == "batch_output" and out_file.bytes == len(output.encode())
    assert {f.id for f in client.files.list(purpose="batch_output")} == {cancelled.output_file_id,
                                                                          cancelled.error_file_id}
    # and an output file is no batch input
    with pytest.raises(openai.BadRequestError) as not_input:
        create_batch(client, cancelled.output_file_id)
    assert not_input.value.param == "input_file_id" and "purpose 'batch'" in not_input.value.message
    # When the output file is deleted, Then it is gone, with the error file and the outputs both render: the batch
    # keeps their ids (as OpenAI's), which answer 404, and its results 410, as when they expire
    deleted = client.files.with_raw_response.delete(cancelled.output_file_id)
    assert FileDeleted.model_validate_json(deleted.text, strict=True).deleted is True
    for file_id in (cancelled.output_file_id, cancelled.error_file_id):
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file_id)
        with pytest.raises(openai.NotFoundError):
            client.files.content(file_id)
    assert client.batches.retrieve(batch.id).output_file_id == cancelled.output_file_id
    for lines in ("results", "errors"):
        gone = httpx.get(f"{client.base_url}batches/{batch.id}/{lines}",
                         headers={"Authorization": f"Bearer {client.api_key}"})
        assert gone.status_code == 410 and "file was deleted" in gone.json()["error"]["message"], gone.text
    assert [r.output_text for r in requests_of(runtime, batch.id)] == [None, None, None]


def test_a_line_of_n_choices_answers_one_chat_completion_with_n_choices(runtime: Runtime, sdk: Callable[..., OpenAI],
                                                                        tiny_model: Path) -> None:
    # Given a chat batch whose one line asks for 2 choices, both generated (as a worker would) and the job settled
    client = sdk(runtime, new_key(runtime))
    chat = {"custom_id": "two", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": str(tiny_model), "messages": [{"role": "user", "content": "Hi"}], "n": 2,
                     "temperature": 1.0, "max_tokens": 3}}
    raw = client.batches.with_raw_response.create(input_file_id=upload_batch(client, [chat]).id,
                                                  endpoint="/v1/chat/completions", completion_window="24h")
    batch = Batch.model_validate_json(raw.text, strict=True)
    check_lines(runtime, batch.id)
    assert strict_batch(client, batch.id).request_counts == BatchRequestCounts(completed=0, failed=0, total=1)
    with runtime.session() as session:
        token, rows = store.claim_requests(session=session, job_id=batch.id, worker="test", limit=2,
                                           lease_seconds=60, max_attempts=5)
        for row, tokens in zip(rows, ([5, 6, 7], [8, 9]), strict=True):
            store.finish_request(session=session, request_id=row.id, token=token, status=RequestStatus.completed,
                                 generated=tokens, finish_reason="stop", output_text=f"choice {row.choice}")
        runtime.lifecycle.settle(session, store.get_job(session=session, job_id=batch.id))
        session.commit()

    # Then the batch completed one line, whose response is one chat.completion with both choices
    done = strict_batch(client, batch.id)
    assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 1
    assert done.output_file_id is not None and done.error_file_id is None
    [result] = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    body = ChatCompletion.model_validate_json(json.dumps(result["response"]["body"]), strict=True)
    assert [(c.index, c.message.content, c.finish_reason) for c in body.choices] == [
        (0, "choice 0", "stop"), (1, "choice 1", "stop")]
    assert body.usage is not None and body.usage.completion_tokens == 5


def test_chat_logprobs_are_reported_in_openais_shape(runtime: Runtime, sdk: Callable[..., OpenAI],
                                                    tiny_model: Path) -> None:
    # Given a chat line asking logprobs with the 2 most likely tokens, generated (as a worker checkpoints it)
    client = sdk(runtime, new_key(runtime))
    chat = {"custom_id": "scored", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": str(tiny_model), "messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                     "top_logprobs": 2, "max_tokens": 2}}
    raw = client.batches.with_raw_response.create(input_file_id=upload_batch(client, [chat]).id,
                                                  endpoint="/v1/chat/completions", completion_window="24h")
    batch_id = Batch.model_validate_json(raw.text, strict=True).id
    check_lines(runtime, batch_id)
    entries = [["Hé", -0.25, [["Hé", -0.25], ["Ho", -1.5]]], ["!", -0.5, [["!", -0.5], [".", -2.0]]]]
    with runtime.session() as session:
        token, [row] = store.claim_requests(session=session, job_id=batch_id, worker="test", limit=1,
                                            lease_seconds=60, max_attempts=5)
        assert row.top_logprobs == 2 and row.generated_logprobs == []
        store.checkpoint(session=session, token=token, progress={row.id: [5, 6]}, texts={row.id: "Hé!"},
                         logprobs={row.id: entries}, lease_seconds=60)
        store.finish_request(session=session, request_id=row.id, token=token, status=RequestStatus.completed,
                             generated=[5, 6], finish_reason="length", output_text="Hé!")
        runtime.lifecycle.settle(session, store.get_job(session=session, job_id=batch_id))
        session.commit()

    # Then the choice's logprobs are OpenAI's: each token with its logprob, UTF-8 bytes and top 2
    done = strict_batch(client, batch_id)
    assert done.output_file_id is not None
    [result] = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    body = ChatCompletion.model_validate_json(json.dumps(result["response"]["body"]), strict=True)
    logprobs = body.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [(t.token, t.logprob, t.bytes) for t in logprobs.content] == [("Hé", -0.25, [72, 195, 169]),
                                                                          ("!", -0.5, [33])]
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in logprobs.content] == [
        [("Hé", -0.25), ("Ho", -1.5)], [("!", -0.5), (".", -2.0)]]


# ---- end to end: `swarmbatch api` + `swarmbatch worker` processes on a tiny-model swarm ----------------------------
def reference(model_dir: Path, prompt: str, max_new_tokens: int) -> tuple[str, list[float]]:
    """Local greedy generation with transformers: the text, decoded as the service decodes, and each generated
    token's log-probability under the model."""
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    new = out.sequences[0, ids.input_ids.shape[1]:]
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[token]) for step, token in zip(out.logits, new, strict=True)]
    return str(tokenizer.decode(new, skip_special_tokens=True)), logprobs


def reference_text(model_dir: Path, prompt: str, max_new_tokens: int) -> str:
    """Local greedy generation's text."""
    return reference(model_dir, prompt, max_new_tokens)[0]


def test_the_sdk_batch_flow_runs_end_to_end_on_a_real_swarm(runtime: Runtime, shared_swarm: LocalSwarm,
                                                           tiny_model: Path, tmp_path: Path) -> None:
    # Given `swarmbatch api` and `swarmbatch worker` processes on one store, and the tiny model's swarm
    settings = runtime.settings.model_copy(update={"initial_peers": shared_swarm.initial_peers,
                                                   "worker_batch_size": 4, "sweep_interval": 2.0})
    api, url = start_api(runtime, tmp_path)
    worker = start_local_worker(settings, log_dir=tmp_path, name="worker")
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key=new_key(runtime), max_retries=0)
        model = str(tiny_model)
        sampled = {"temperature": 1.0, "top_p": 0.9}
        lines = [line(f"req-{i}", p, model) for i, p in enumerate(PROMPTS)] + [
            line("bad", "x", model, stream=True),
            line("three", PROMPTS[0], model, n=3, seed=7, **sampled),
            *(line(f"alone-{c}", PROMPTS[0], model, seed=store.choice_seed(7, c), **sampled) for c in range(3)),
            line("scored", PROMPTS[1], model, logprobs=2)]

        # When a user runs OpenAI's documented batch flow
        uploaded = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 240
        while (batch := strict_batch(client, batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, f"the batch did not end: {batch.status}; see {worker.log_path}"
            time.sleep(1)

        # Then it completes, stamped at each step
        assert batch.status == "completed", batch
        assert batch.in_progress_at and batch.finalizing_at and batch.completed_at and batch.output_file_id
        assert batch.request_counts is not None and (batch.request_counts.completed, batch.request_counts.failed) \
            == (len(PROMPTS) + 5, 0)
        # and its output file holds every line once, in OpenAI's text_completion shape
        results = {(r := json.loads(x))["custom_id"]: r for x in client.files.content(batch.output_file_id).text.splitlines()}
        assert list(results) == [f"req-{i}" for i in range(len(PROMPTS))] + ["three", "alone-0", "alone-1", "alone-2",
                                                                              "scored"]
        bodies = {custom_id: Completion.model_validate_json(json.dumps(r["response"]["body"]), strict=True)
                  for custom_id, r in results.items()}
        # with greedy texts equal to local generation
        for i, prompt in enumerate(PROMPTS):
            assert bodies[f"req-{i}"].choices[0].text == reference_text(tiny_model, prompt, 6)
        # and n=3 as three seeded choices, each what a request of its own with the choice's seed generates
        three = [choice.text for choice in bodies["three"].choices]
        assert [c.index for c in bodies["three"].choices] == [0, 1, 2] and len(set(three)) > 1
        assert three == [bodies[f"alone-{c}"].choices[0].text for c in range(3)]
        # and logprobs: each greedy token's log-probability under the model, the most likely of the 2 reported
        scored = bodies["scored"].choices[0]
        assert scored.logprobs is not None and bodies["req-1"].choices[0].logprobs is None
        text, expected = reference(tiny_model, PROMPTS[1], 6)
        assert scored.text == text and len(scored.logprobs.tokens or []) == len(expected)
        assert scored.logprobs.token_logprobs == pytest.approx(expected, abs=1e-3)
        for token, logprob, top in zip(scored.logprobs.tokens or [], scored.logprobs.token_logprobs or [],
                                       scored.logprobs.top_logprobs or [], strict=True):
            assert len(top) <= 2 and max(top.values()) == pytest.approx(logprob, abs=1e-6) and token in top
        # and its error file holds the bad line, naming the parameter
        assert batch.error_file_id is not None
        [error] = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
        assert (error["custom_id"], error["error"]["code"], error["error"]["param"]) == (
            "bad", "unsupported_parameter", "body.stream")
        client.close()
    finally:
        worker.terminate()
        api.terminate()


def docs_style_lines() -> list[dict[str, Any]]:
    """Lines as OpenAI's docs write them: model gpt-4o-mini, a developer message, content as text parts, no
    temperature and no seed; two of them identical but for their custom_id."""
    def line(custom_id: str, question: str) -> dict[str, Any]:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "gpt-4o-mini", "max_tokens": 6, "messages": [
                    {"role": "developer", "content": "You are a helpful assistant."},
                    {"role": "user", "content": [{"type": "text", "text": question}]}]}}
    return [line("request-1", "Hello world!"), line("request-2", "Hello world!"), line("request-3", "Name a river.")]


def test_a_batch_file_written_as_openais_docs_write_it_runs_unchanged_through_an_alias(
        runtime: Runtime, shared_swarm: LocalSwarm, tiny_model: Path, tmp_path: Path) -> None:
    # Given `swarmbatch api` and `swarmbatch worker` processes, the tiny model served under the alias gpt-4o-mini
    settings = runtime.settings.model_copy(update={"initial_peers": shared_swarm.initial_peers,
                                                   "worker_batch_size": 4, "sweep_interval": 2.0})
    api, url = start_api(runtime, tmp_path)
    worker = start_local_worker(settings, log_dir=tmp_path, name="worker")
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key=new_key(runtime), max_retries=0)
        # When a user runs OpenAI's documented flow with a file as OpenAI's docs write it
        uploaded = client.files.create(file=("docs.jsonl", jsonl(docs_style_lines())), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        assert batch.errors is None and batch.status == "validating"
        deadline = time.monotonic() + 240
        while (batch := strict_batch(client, batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, f"the batch did not end: {batch.status}; see {worker.log_path}"
            time.sleep(1)

        # Then it completes every line, each answer a chat.completion the SDK validates strictly
        assert batch.status == "completed" and batch.output_file_id is not None and batch.error_file_id is None
        assert batch.request_counts is not None and batch.request_counts.completed == 3
        assert batch.model == str(tiny_model)  # the model the alias the lines name stands for
        results = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        bodies = {r["custom_id"]: ChatCompletion.model_validate_json(json.dumps(r["response"]["body"]), strict=True)
                  for r in results}
        assert list(bodies) == ["request-1", "request-2", "request-3"]
        assert all(b.choices[0].message.role == "assistant" and b.usage is not None for b in bodies.values())
        # sampled at temperature 1 with seeds drawn at submission and stored: the two identical lines differ
        seeds = {r.custom_id: r.seed for r in requests_of(runtime, batch.id)}
        assert seeds["request-1"] != seeds["request-2"]
        assert bodies["request-1"].choices[0].message.content != bodies["request-2"].choices[0].message.content
        # and the batch's usage, validated by the SDK's BatchUsage, sums the lines' usage
        assert batch.usage is not None
        assert batch.usage.input_tokens == sum(b.usage.prompt_tokens for b in bodies.values() if b.usage)
        assert batch.usage.output_tokens == sum(b.usage.completion_tokens for b in bodies.values() if b.usage) > 0
        assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
        assert batch.usage.input_tokens_details.cached_tokens == batch.usage.output_tokens_details.reasoning_tokens == 0
        client.close()
    finally:
        worker.terminate()
        api.terminate()


REVIEW_SCHEMA = {"type": "object", "additionalProperties": False,
                 "required": ["sentiment", "stars", "topics", "language"],
                 "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
                                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                "topics": {"type": "array", "maxItems": 3, "items": {
                                    "type": "string", "enum": ["price", "quality", "delivery", "service"]}},
                                "language": {"type": "string", "pattern": "^[a-z]{2}$"}}}


class Review(BaseModel):
    """The answer REVIEW_SCHEMA describes, as a user's pydantic model of it."""

    model_config = ConfigDict(extra="forbid")
    sentiment: Literal["positive", "negative", "neutral"]
    stars: Annotated[int, Field(ge=1, le=5)]
    topics: Annotated[list[Literal["price", "quality", "delivery", "service"]], Field(max_length=3)]
    language: Annotated[str, Field(pattern=r"^[a-z]{2}$")]


def structured_docs_lines() -> list[dict[str, Any]]:
    """Structured-output lines as OpenAI's docs write them: gpt-4o-mini, a developer message, text parts, a strict
    JSON schema in response_format, no temperature and no seed. The longest answer the schema allows is 93 characters,
    so 100 tokens always let it finish (a random model may well spell it one character per token)."""
    def line(custom_id: str, review: str) -> dict[str, Any]:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "gpt-4o-mini", "max_tokens": 100, "messages": [
                    {"role": "developer", "content": [{"type": "text", "text": "Classify the customer review."}]},
                    {"role": "user", "content": [{"type": "text", "text": review}]}],
                    "response_format": {"type": "json_schema", "json_schema": {
                        "name": "review_classification", "strict": True, "schema": REVIEW_SCHEMA}}}}
    reviews = ["Arrived late but works well.", "Too expensive for what it is.", "Great support team!",
               "The box was damaged.", "Exactly as described."]
    return [line(f"review-{i}", review) for i, review in enumerate(reviews)]


def test_a_structured_output_batch_written_as_openais_docs_write_it_runs_unchanged_through_an_alias(
        runtime: Runtime, shared_swarm: LocalSwarm, tmp_path: Path) -> None:
    # Given `swarmbatch api` and `swarmbatch worker` processes, the tiny model served under the alias gpt-4o-mini
    settings = runtime.settings.model_copy(update={"initial_peers": shared_swarm.initial_peers,
                                                   "worker_batch_size": 4, "sweep_interval": 2.0})
    api, url = start_api(runtime, tmp_path)
    worker = start_local_worker(settings, log_dir=tmp_path, name="worker")
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key=new_key(runtime), max_retries=0)
        # When a user runs OpenAI's documented flow with structured-output lines as OpenAI's docs write them
        uploaded = client.files.create(file=("reviews.jsonl", jsonl(structured_docs_lines())), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        assert batch.errors is None
        deadline = time.monotonic() + 240
        while (batch := strict_batch(client, batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, f"the batch did not end: {batch.status}; see {worker.log_path}"
            time.sleep(1)

        # Then every line completes as a chat.completion the SDK validates strictly
        assert batch.status == "completed" and batch.output_file_id is not None and batch.error_file_id is None
        results = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        bodies = {r["custom_id"]: ChatCompletion.model_validate_json(json.dumps(r["response"]["body"]), strict=True)
                  for r in results}
        assert sorted(bodies) == [f"review-{i}" for i in range(5)]
        # and each answer ended by itself, as JSON its schema validates and the user's pydantic model parses strictly
        for body in bodies.values():
            [choice] = body.choices
            assert choice.finish_reason == "stop" and choice.message.content is not None
            jsonschema.validate(json.loads(choice.message.content), REVIEW_SCHEMA)
            Review.model_validate_json(choice.message.content, strict=True)
        # and sampled at temperature 1 with seeds of their own: the answers are not all one
        assert len({body.choices[0].message.content for body in bodies.values()}) > 1
        client.close()
    finally:
        worker.terminate()
        api.terminate()
