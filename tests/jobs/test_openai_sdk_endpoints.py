"""The official `openai` SDK's batch flow for `/v1/embeddings` and `/v1/responses`, on real swarms with `swarmbatch api`
and `swarmbatch worker` processes: every object validated strictly by the SDK's own models, every number checked
against local transformers."""
from __future__ import annotations

import base64
import json
import struct
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch
from factories import new_key
from jobs_support import requests_of, start_api
from openai import OpenAI
from openai.types import Batch, CreateEmbeddingResponse
from openai.types.responses import Response, ResponseFormatTextJSONSchemaConfig
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from jobs.runtime import Runtime
from launch.local_swarm import LocalSwarm
from launch.local_worker import start_local_worker

# a strict schema as OpenAI's docs write them (every property required, no others), bounded so that the longest answer
# (71 characters) finishes within max_output_tokens even spelled one character per token
RIVER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["river", "length_km", "countries"],
                "properties": {"river": {"type": "string", "enum": ["Nile", "Amazon", "Danube", "Rhine"]},
                               "length_km": {"type": "integer", "minimum": 1, "maximum": 9999},
                               "countries": {"type": "array", "maxItems": 2, "items": {
                                   "type": "string", "pattern": "^[A-Z][a-z]{1,7}$"}}}}
TEXTS = ["The city council voted", "Once upon a time there was a library", "Rain fell on the valley"]
ENDED = ("completed", "failed", "expired", "cancelled")


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "\n".join(json.dumps(x) for x in lines).encode() + b"\n"


def run_batch(client: OpenAI, lines: list[dict[str, Any]], endpoint: str, log: Path) -> Batch:
    """Upload the lines, create the batch for `endpoint`, and wait for it to end; the batch object, strictly
    validated."""
    uploaded = client.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint,  # type: ignore[arg-type]
                                  completion_window="24h")
    deadline = time.monotonic() + 240
    while True:
        batch = Batch.model_validate_json(client.batches.with_raw_response.retrieve(batch.id).text, strict=True)
        if batch.status in ENDED:
            return batch
        assert time.monotonic() < deadline, f"the batch did not end: {batch.status}; see {log}"
        time.sleep(1)


def outputs(client: OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    assert file_id is not None
    return {(r := json.loads(x))["custom_id"]: r for x in client.files.content(file_id).text.splitlines()}


def mean_pooled(model_dir: Path, text: str) -> torch.Tensor:
    """transformers' base model on one text, mean-pooled (not normalized): what the embedding model declares."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokenizer(text).input_ids])).last_hidden_state[0].mean(0)


def unit(vector: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vector, dim=-1)


def assert_close(got: list[float], expected: torch.Tensor) -> None:
    vector = torch.tensor(got)
    assert vector.shape == expected.shape
    assert torch.nn.functional.cosine_similarity(vector, expected, dim=0) > 1 - 1e-4


def test_an_embeddings_batch_runs_through_the_swarm_and_equals_local_transformers(
        make_runtime: Any, redis_url: str, embedding_swarm: LocalSwarm, embedding_model: Path, tmp_path: Path
        ) -> None:
    # Given `swarmbatch api` and `swarmbatch worker` processes serving the tiny embedding model (mean pooling,
    # normalized, Matryoshka sizes 16 and 32) on its swarm
    runtime: Runtime = make_runtime(broker_url=redis_url, api_models=[str(embedding_model)],
                                    model_aliases={"text-embedding-3-small": str(embedding_model)},
                                    initial_peers=embedding_swarm.initial_peers, worker_batch_size=4,
                                    sweep_interval=2.0)
    api, url = start_api(runtime, tmp_path)
    worker = start_local_worker(runtime.settings, log_dir=tmp_path, name="worker")
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key=new_key(runtime), max_retries=0)
        body = {"model": "text-embedding-3-small"}
        lines = [{"custom_id": "one", "method": "POST", "url": "/v1/embeddings", "body": {**body, "input": TEXTS[0]}},
                 {"custom_id": "many", "method": "POST", "url": "/v1/embeddings", "body": {**body, "input": TEXTS}},
                 {"custom_id": "b64", "method": "POST", "url": "/v1/embeddings",
                  "body": {**body, "input": TEXTS[1], "encoding_format": "base64"}},
                 {"custom_id": "short", "method": "POST", "url": "/v1/embeddings",
                  "body": {**body, "input": TEXTS[2], "dimensions": 16}},
                 {"custom_id": "odd", "method": "POST", "url": "/v1/embeddings",
                  "body": {**body, "input": TEXTS[2], "dimensions": 10}}]

        # When a user runs OpenAI's batch flow with endpoint /v1/embeddings
        batch = run_batch(client, lines, "/v1/embeddings", worker.log_path)

        # Then it completes every good line, and the line asking a size the model was not trained for is an error
        assert batch.status == "completed" and batch.endpoint == "/v1/embeddings", batch
        assert batch.request_counts is not None and batch.request_counts.completed == 4
        assert batch.errors is not None and [(e.line, e.code, e.param) for e in batch.errors.data or []] == [
            (5, "unsupported_parameter", "body.dimensions")]
        results = outputs(client, batch.output_file_id)
        assert list(results) == ["one", "many", "b64", "short"]
        # each answer an embeddings list the SDK validates strictly (base64 decoded to its floats first)
        raw = {cid: r["response"]["body"] for cid, r in results.items()}
        encoded = raw["b64"]["data"][0]["embedding"]
        raw["b64"]["data"][0]["embedding"] = list(struct.unpack(f"<{len(base64.b64decode(encoded)) // 4}f",
                                                                base64.b64decode(encoded)))
        bodies = {cid: CreateEmbeddingResponse.model_validate_json(json.dumps(b), strict=True)
                  for cid, b in raw.items()}
        # equal to transformers' base model with the model's pooling within 1e-4 cosine, in input order
        assert_close(bodies["one"].data[0].embedding, unit(mean_pooled(embedding_model, TEXTS[0])))
        assert [d.index for d in bodies["many"].data] == [0, 1, 2]
        for text, item in zip(TEXTS, bodies["many"].data, strict=True):
            assert_close(item.embedding, unit(mean_pooled(embedding_model, text)))
        assert_close(bodies["b64"].data[0].embedding, unit(mean_pooled(embedding_model, TEXTS[1])))
        # dimensions: the first 16 values of the pooled vector, normalized again
        assert_close(bodies["short"].data[0].embedding, unit(mean_pooled(embedding_model, TEXTS[2])[:16]))
        # usage: each input's tokens, in the lines and in the batch object
        tokenizer = AutoTokenizer.from_pretrained(embedding_model)
        assert bodies["many"].usage.prompt_tokens == bodies["many"].usage.total_tokens == sum(
            len(tokenizer(t).input_ids) for t in TEXTS)
        assert batch.usage is not None and batch.usage.output_tokens == 0
        assert batch.usage.input_tokens == batch.usage.total_tokens == sum(b.usage.prompt_tokens for b in bodies.values())
        # each input was stored compactly: its float32 bytes
        stored = {r.custom_id: r.embedding for r in requests_of(runtime, batch.id) if r.choice == 0}
        assert len(stored["one"] or b"") == 4 * 64 and len(stored["short"] or b"") == 4 * 16
        client.close()
    finally:
        worker.terminate()
        api.terminate()


def greedy_chat(model_dir: Path, messages: list[dict[str, str]], max_new_tokens: int) -> tuple[str, int, int]:
    """Local greedy generation of a chat: its text, prompt tokens and new tokens."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    new = out[0, ids.shape[1]:].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), ids.shape[1], len(new)


def test_a_responses_batch_answers_response_objects_equal_to_the_chat_they_amount_to(
        make_runtime: Any, redis_url: str, shared_swarm: LocalSwarm, tiny_model: Path, tmp_path: Path
        ) -> None:
    # Given `swarmbatch api` and `swarmbatch worker` processes serving the tiny model on its swarm
    runtime: Runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)],
                                    model_aliases={"gpt-4o-mini": str(tiny_model)},
                                    initial_peers=shared_swarm.initial_peers, worker_batch_size=4,
                                    sweep_interval=2.0)
    api, url = start_api(runtime, tmp_path)
    worker = start_local_worker(runtime.settings, log_dir=tmp_path, name="worker")
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key=new_key(runtime), max_retries=0)
        greedy = {"model": "gpt-4o-mini", "temperature": 0}
        lines = [
            {"custom_id": "plain", "method": "POST", "url": "/v1/responses",
             "body": {**greedy, "input": "Once upon a time", "max_output_tokens": 6}},
            {"custom_id": "items", "method": "POST", "url": "/v1/responses",
             "body": {**greedy, "instructions": "You are a helpful assistant.", "max_output_tokens": 200,
                      "metadata": {"team": "docs"}, "text": {"format": {"type": "text"}},
                      "input": [{"role": "user", "content": [{"type": "input_text", "text": "Name a river."}]}]}},
            {"custom_id": "json", "method": "POST", "url": "/v1/responses",
             "body": {**greedy, "max_output_tokens": 100, "input": "Describe a river as JSON.",
                      "text": {"format": {"type": "json_schema", "name": "river", "strict": True,
                                          "schema": RIVER_SCHEMA}}}},
            {"custom_id": "image", "method": "POST", "url": "/v1/responses",
             "body": {**greedy, "input": [{"role": "user", "content": [
                 {"type": "input_image", "image_url": "https://example.com/a.png"}]}]}}]

        # When a user runs OpenAI's batch flow with endpoint /v1/responses
        batch = run_batch(client, lines, "/v1/responses", worker.log_path)

        # Then it completes, and the image part is a line error naming it
        assert batch.status == "completed" and batch.request_counts is not None, batch
        assert batch.request_counts.completed == 3
        assert batch.errors is not None and [(e.line, e.code, e.param) for e in batch.errors.data or []] == [
            (4, "unsupported_content", "body.input[0].content[0].type")]
        results = outputs(client, batch.output_file_id)
        bodies = {cid: Response.model_validate_json(json.dumps(r["response"]["body"]), strict=True)
                  for cid, r in results.items()}
        assert list(bodies) == ["plain", "items", "json"]
        # each a Responses object with one assistant message, its text what the chat it amounts to generates locally
        text, prompt, new = greedy_chat(tiny_model, [{"role": "user", "content": "Once upon a time"}], 6)
        plain = bodies["plain"]
        assert plain.object == "response" and plain.output_text == text
        assert [(o.type, o.role) for o in plain.output] == [("message", "assistant")]  # type: ignore[union-attr]
        assert plain.usage is not None and (plain.usage.input_tokens, plain.usage.output_tokens) == (prompt, new)
        # cut by max_output_tokens: incomplete, saying why
        reason = plain.incomplete_details.reason if plain.incomplete_details else None
        assert (plain.status, reason) == (("incomplete", "max_output_tokens") if new == 6 else ("completed", None))
        # instructions are the system message before the input, and echoed with the metadata
        items = bodies["items"]
        text, prompt, new = greedy_chat(tiny_model, [{"role": "system", "content": "You are a helpful assistant."},
                                                     {"role": "user", "content": "Name a river."}], 200)
        assert items.output_text == text and items.usage is not None and items.usage.input_tokens == prompt
        assert items.instructions == "You are a helpful assistant." and items.metadata == {"team": "docs"}
        assert items.status == ("completed" if new < 200 else "incomplete")
        # a strict JSON schema text format: the answer ended by itself as JSON the schema validates, and the format is
        # echoed as the SDK's own JSON-schema config
        structured = bodies["json"]
        assert structured.status == "completed" and structured.incomplete_details is None
        jsonschema.validate(json.loads(structured.output_text), RIVER_SCHEMA)
        echoed = structured.text.format if structured.text else None
        assert isinstance(echoed, ResponseFormatTextJSONSchemaConfig)
        assert (echoed.name, echoed.strict, echoed.schema_) == ("river", True, RIVER_SCHEMA)
        assert batch.usage is not None and batch.usage.input_tokens == sum(
            b.usage.input_tokens for b in bodies.values() if b.usage)
        client.close()
    finally:
        worker.terminate()
        api.terminate()
