"""Models and aliases (SWARMBATCH_MODEL_ALIASES, GET /v1/models), and a batch's usage, over a real uvicorn + store.

No worker runs: where a test needs finished requests it writes them with the store's own verbs, as a worker would.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from factories import new_key
from jobs_support import ApiClient, check_lines
from pydantic import ValidationError

from jobs import store
from jobs.models import RequestStatus
from jobs.runtime import Runtime
from jobs.settings import Settings


@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime], redis_url: str, tiny_model: Path) -> Runtime:
    """The API serves smollm2 and the tiny model; gpt-4o-mini and tiny-chat are aliases of the tiny model."""
    return make_runtime(broker_url=redis_url, api_models=["smollm2", str(tiny_model)],
                        model_aliases={"gpt-4o-mini": str(tiny_model), "tiny-chat": str(tiny_model)})



def chat_line(custom_id: str, model: str, content: str = "Hello there") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}}


def test_aliases_are_read_from_the_environment_as_alias_model_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMBATCH_API_MODELS", "smollm2,/models/big one")
    monkeypatch.setenv("SWARMBATCH_MODEL_ALIASES", " gpt-4o-mini=smollm2, gpt-4o = /models/big one ,,o1=smollm2")
    settings = Settings()
    assert settings.model_aliases == {"gpt-4o-mini": "smollm2", "gpt-4o": "/models/big one", "o1": "smollm2"}
    assert settings.resolve_model("gpt-4o") == "/models/big one" and settings.resolve_model("smollm2") == "smollm2"
    assert settings.aliases_of("smollm2") == ["gpt-4o-mini", "o1"]


@pytest.mark.parametrize(("aliases", "message"), [
    ("gpt-4o-mini", "is not ALIAS=MODEL"),
    ("=smollm2", "is not ALIAS=MODEL"),
    ("gpt-4o=llama-3.1-70b", "SWARMBATCH_API_MODELS does not list"),
    ("smollm2=smollm2", "a served model's own name"),
    ("a=smollm2,a=smollm2", "given twice"),
])
def test_a_bad_alias_setting_is_refused_in_one_line_saying_what_to_write(monkeypatch: pytest.MonkeyPatch,
                                                                         aliases: str, message: str) -> None:
    monkeypatch.delenv("SWARMBATCH_API_MODELS", raising=False)
    monkeypatch.setenv("SWARMBATCH_MODEL_ALIASES", aliases)
    with pytest.raises(ValidationError, match=message):
        Settings()


def test_models_are_listed_and_retrieved_in_openais_shape_with_their_aliases(runtime: Runtime, client: ApiClient,
                                                                            tiny_model: Path) -> None:
    api = client(runtime, new_key(runtime))
    listed = api.get("/v1/models")
    assert listed.status_code == 200 and listed.json()["object"] == "list"
    models = listed.json()["data"]
    assert [(m["id"], m["root"]) for m in models] == [
        ("smollm2", "smollm2"), (str(tiny_model), str(tiny_model)), ("gpt-4o-mini", str(tiny_model)),
        ("tiny-chat", str(tiny_model))]
    assert all(m["object"] == "model" and m["owned_by"] == "swarmbatch" and isinstance(m["created"], int)
               for m in models)
    # a path with slashes and an alias are retrieved by their ids
    assert api.get(f"/v1/models/{tiny_model}").json() == models[1]
    assert api.get("/v1/models/gpt-4o-mini").json() == models[2]


def test_an_unknown_model_is_a_404_in_openais_error_body_and_models_need_a_key(runtime: Runtime,
                                                                              client: ApiClient) -> None:
    missing = client(runtime, new_key(runtime)).get("/v1/models/gpt-5")
    assert missing.status_code == 404
    assert missing.json() == {"error": {"type": "ModelNotFound", "code": "model_not_found", "param": "model",
                                        "message": "the model 'gpt-5' does not exist here; list the models with "
                                                   "GET /v1/models"}}
    assert client(runtime, None).get("/v1/models").status_code == 401


def test_a_batch_naming_an_alias_runs_the_served_model_and_a_line_naming_another_model_is_a_line_error(
        runtime: Runtime, client: ApiClient, tiny_model: Path) -> None:
    # Given a batch whose lines name the model by two aliases and by its path, and one line naming another model
    api = client(runtime, new_key(runtime))
    lines = [chat_line("a", "gpt-4o-mini"), chat_line("b", "tiny-chat"), chat_line("c", str(tiny_model)),
             chat_line("d", "gpt-4o")]
    upload = api.post("/v1/files", files={"file": ("b.jsonl", "\n".join(json.dumps(x) for x in lines).encode())},
                      data={"purpose": "batch"})
    # When it is created the OpenAI way (the model is the lines')
    created = api.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions",
                                            "completion_window": "24h"})
    assert created.status_code == 200, created.text
    check_lines(runtime, created.json()["id"])  # as a worker does next
    # Then the job runs the served model, with the three lines, and the fourth is a line error naming gpt-4o
    batch = api.get(f"/v1/batches/{created.json()['id']}").json()
    assert batch["model"] == str(tiny_model) and batch["request_counts"]["total"] == 3
    [error] = batch["errors"]["data"]
    assert (error["line"], error["code"], error["param"]) == (4, "model_mismatch", "body.model")
    assert '"gpt-4o"' in error["message"]


def test_the_batch_usage_sums_the_prompt_and_generated_tokens_of_the_lines_with_output(
        runtime: Runtime, client: ApiClient, tiny_model: Path) -> None:
    # Given a batch of three lines, two of them finished with 3 and 2 tokens, the third not started
    api = client(runtime, new_key(runtime))
    lines = [chat_line(f"r{i}", str(tiny_model), "word " * (i + 1)) for i in range(3)]
    job_id = api.post("/v1/batches", json={"model": str(tiny_model), "requests": lines}).json()["id"]
    check_lines(runtime, job_id)
    assert api.get(f"/v1/batches/{job_id}").json()["usage"] == {
        "input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}
    with runtime.session() as session:
        token, rows = store.claim_requests(session=session, job_id=job_id, worker="test", limit=2, lease_seconds=60,
                                           max_attempts=5)
        for row, generated in zip(rows, ([5, 6, 7], [8, 9]), strict=True):
            store.finish_request(session=session, request_id=row.id, token=token, status=RequestStatus.completed,
                                 generated=generated, finish_reason="length", output_text="x")
        prompts = [len(row.prompt_ids) for row in rows]
        session.commit()
    # Then the batch's usage counts those two lines, as their responses' usage does
    usage = api.get(f"/v1/batches/{job_id}").json()["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (
        sum(prompts), 5, sum(prompts) + 5)
    responses = [json.loads(x)["response"]["body"]["usage"]
                 for x in api.get(f"/v1/batches/{job_id}/results").text.splitlines()]
    assert sum(r["prompt_tokens"] for r in responses) == usage["input_tokens"]
    assert sum(r["completion_tokens"] for r in responses) == usage["output_tokens"]
