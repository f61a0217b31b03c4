"""`/v1/embeddings` and `/v1/responses` batch lines: what they become, and the line errors naming what is wrong; and the
embedding recipe read from a model's sentence-transformers files."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jobs import store
from jobs.batch_input import InputLimits, ParsedBatch, parse_batch_file
from jobs.line_embeddings import EmbeddingModel
from modelprep import write_tiny_embedding_model
from swarmclient.pooling import Pooling, PoolingMode, read_pooling
from swarmclient.textgen import load_tokenizer
from swarmnet.errors import ModelDirError
from swarmnet.model_spec import ModelSpec

MODEL = "tiny-llama"
MATRYOSHKA = EmbeddingModel(64, Pooling(PoolingMode.mean, True, (16, 32)))
LIMITS = InputLimits(max_file_bytes=100_000, max_lines=100, max_tokens_cap=512, context_length=64,
                     embedding=MATRYOSHKA)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return load_tokenizer(tiny_model)


def line(custom_id: str, url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": MODEL, **body}}


def parse(tokenizer: Any, *lines: dict[str, Any], limits: InputLimits = LIMITS) -> ParsedBatch:
    data = "\n".join(json.dumps(x) for x in lines).encode()
    return parse_batch_file(data, tokenizer=tokenizer, model_name=MODEL, limits=limits)


def errors(batch: ParsedBatch) -> list[tuple[str | None, str, str | None]]:
    return [(e.custom_id, e.code, e.param) for e in batch.errors]


# ---- embeddings -----------------------------------------------------------------------------------------------------
def test_an_embeddings_line_becomes_one_request_per_input_tokenized_as_sentence_transformers_does(tokenizer: Any
                                                                                                  ) -> None:
    batch = parse(tokenizer, line("one", "/v1/embeddings", input="The city council"),
                  line("many", "/v1/embeddings", input=["Rain", "fell on the"], dimensions=16,
                       encoding_format="base64"),
                  line("ids", "/v1/embeddings", input=[[5, 6, 7], [8]]))
    assert batch.endpoint == "/v1/embeddings" and batch.errors == []
    assert [(r.custom_id, r.n) for r in batch.requests] == [("one", 1), ("many", 2), ("ids", 2)]
    assert batch.requests[0].inputs == [tokenizer("The city council").input_ids]
    assert batch.requests[1].inputs == [tokenizer("Rain").input_ids, tokenizer("fell on the").input_ids]
    # each input is a request row of its own: its index as the choice, its tokens as the prompt
    rows = store.request_rows(batch)
    assert [(r.custom_id, r.choice, r.prompt_ids, r.prompt_count) for r in rows][-2:] == [
        ("ids", 0, [5, 6, 7], 3), ("ids", 1, [8], 1)]


@pytest.mark.parametrize(("body", "code", "param"), [
    ({"input": ""}, "invalid_input", "body.input"),
    ({"input": []}, "invalid_input", "body.input"),
    ({"input": ["fine", ""]}, "invalid_input", "body.input[1]"),
    ({"input": [[1, 2], [10**9]]}, "invalid_input", "body.input[1]"),
    ({"input": "word " * 200}, "context_length_exceeded", "body.input"),
    ({"input": "x", "encoding_format": "int8"}, "invalid_parameter", "body.encoding_format"),
    ({"input": "x", "dimensions": 0}, "invalid_parameter", "body.dimensions"),
    ({"input": "x", "dimensions": 24}, "unsupported_parameter", "body.dimensions"),
    ({"input": "x", "user": "u", "temperature": 0}, "unsupported_parameter", "body.temperature"),
], ids=["empty", "empty-list", "empty-item", "token-out-of-vocab", "too-long", "encoding", "zero-dims",
        "unlisted-dims", "sampling"])
def test_a_bad_embeddings_line_is_an_error_naming_the_input_or_parameter(tokenizer: Any, body: dict[str, Any],
                                                                         code: str, param: str) -> None:
    batch = parse(tokenizer, line("good", "/v1/embeddings", input="fine"), line("bad", "/v1/embeddings", **body))
    assert errors(batch) == [("bad", code, param)]


def test_dimensions_are_refused_for_a_model_that_declares_no_matryoshka_sizes(tokenizer: Any) -> None:
    plain = InputLimits(max_file_bytes=100_000, max_lines=100, max_tokens_cap=512, context_length=64,
                        embedding=EmbeddingModel(64, Pooling()))
    batch = parse(tokenizer, line("good", "/v1/embeddings", input="x"),
                  line("cut", "/v1/embeddings", input="x", dimensions=16), limits=plain)
    assert errors(batch) == [("cut", "unsupported_parameter", "body.dimensions")]
    assert "not trained for shorter embeddings" in batch.errors[0].message


def test_an_input_longer_than_the_models_sentence_transformers_max_seq_length_is_a_line_error_naming_it(
        tmp_path: Path) -> None:
    # Given the tiny embedding model with a sentence_bert_config.json whose max_seq_length (8) is below its context
    model_dir = write_tiny_embedding_model(tmp_path / "short-embedder", layers=1, max_seq_length=8)
    spec = ModelSpec.open(model_dir)
    pooling = read_pooling(model_dir, spec.config)
    assert (pooling.max_seq_length, pooling.lower_case) == (8, False) and spec.max_length > 8
    tokenizer = load_tokenizer(model_dir)
    limits = InputLimits(max_file_bytes=100_000, max_lines=100, max_tokens_cap=512, context_length=spec.max_length,
                         embedding=EmbeddingModel(spec.config.hidden_size, pooling))
    fits = "Rain fell"
    too_long = "Rain fell on the valley all night and into the morning"
    assert len(tokenizer(fits).input_ids) <= 8 < len(tokenizer(too_long).input_ids)
    # When lines embed texts and token ids under and over it
    batch = parse(tokenizer, line("fits", "/v1/embeddings", input=fits),
                  line("text", "/v1/embeddings", input=["ok", too_long]),
                  line("ids", "/v1/embeddings", input=list(range(5, 14))),
                  line("eight", "/v1/embeddings", input=list(range(5, 13))), limits=limits)
    # Then the inputs over 8 tokens are refused (sentence-transformers would truncate them silently), naming the limit
    assert [r.custom_id for r in batch.requests] == ["fits", "eight"]
    assert errors(batch) == [("text", "context_length_exceeded", "body.input[1]"),
                             ("ids", "context_length_exceeded", "body.input")]
    assert all("at most 8 tokens (max_seq_length in its sentence_bert_config.json)" in e.message
               for e in batch.errors)


def test_do_lower_case_in_sentence_bert_config_lowercases_inputs_before_they_are_tokenized(tmp_path: Path) -> None:
    model_dir = write_tiny_embedding_model(tmp_path / "lower-embedder", layers=1, max_seq_length=64,
                                           do_lower_case=True)
    pooling = read_pooling(model_dir)
    assert pooling.lower_case
    tokenizer = load_tokenizer(model_dir)
    limits = InputLimits(max_file_bytes=100_000, max_lines=100, max_tokens_cap=512, context_length=64,
                         embedding=EmbeddingModel(64, pooling))
    [request] = parse(tokenizer, line("upper", "/v1/embeddings", input="Rain Fell ON the Valley"),
                      limits=limits).requests
    assert request.inputs == [tokenizer("rain fell on the valley").input_ids]
    assert request.inputs != [tokenizer("Rain Fell ON the Valley").input_ids]


@pytest.mark.parametrize(("settings", "says"), [({"max_seq_length": 0}, "max_seq_length must be a positive integer"),
                                                ({"max_seq_length": "8"}, "max_seq_length must be a positive integer"),
                                                ({"do_lower_case": "yes"}, "do_lower_case must be true or false"),
                                                ([8], "must be a JSON object")])
def test_a_malformed_sentence_bert_config_refuses_the_model_with_one_line(tmp_path: Path, settings: Any, says: str
                                                                         ) -> None:
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps(settings))
    with pytest.raises(ModelDirError, match=says):
        read_pooling(tmp_path)


def test_embeddings_and_generations_never_share_a_batch_the_minority_kind_is_a_line_error(tokenizer: Any) -> None:
    batch = parse(tokenizer, line("e1", "/v1/embeddings", input="a"), line("e2", "/v1/embeddings", input="b"),
                  line("c", "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}]))
    assert [r.custom_id for r in batch.requests] == ["e1", "e2"]
    assert errors(batch) == [("c", "invalid_url", "url")]


# ---- responses ------------------------------------------------------------------------------------------------------
def test_a_responses_line_is_the_chat_it_amounts_to_with_the_echoed_fields_kept(tokenizer: Any) -> None:
    responses = line("r", "/v1/responses", instructions="Be brief.", max_output_tokens=7, temperature=0.5,
                     metadata={"team": "docs"}, text={"format": {"type": "text"}}, store=False,
                     input=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                            {"role": "assistant", "content": "Hello."}, {"role": "developer", "content": "Go on"}])
    chat = line("c", "/v1/chat/completions", max_tokens=7, temperature=0.5, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "developer", "content": "Go on"}])
    [as_responses], [as_chat] = parse(tokenizer, responses).requests, parse(tokenizer, chat).requests
    assert as_responses.url == "/v1/responses"
    assert (as_responses.prompt_ids, as_responses.max_tokens, as_responses.temperature) == (
        as_chat.prompt_ids, as_chat.max_tokens, as_chat.temperature)
    assert {key: as_responses.body[key] for key in ("instructions", "max_output_tokens", "metadata", "text")} == {
        "instructions": "Be brief.", "max_output_tokens": 7, "metadata": {"team": "docs"},
        "text": {"format": {"type": "text"}}}


@pytest.mark.parametrize(("body", "code", "param"), [
    ({"input": ""}, "missing_input", "body.input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "unsupported_content",
     "body.input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]}, "unsupported_content",
     "body.input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "invalid_input", "body.input[0].role"),
    ({"input": "x", "instructions": 3}, "invalid_parameter", "body.instructions"),
    ({"input": "x", "max_output_tokens": 0}, "invalid_parameter", "body.max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10_000}, "max_tokens_too_large", "body.max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "invalid_parameter", "body.text.format"),
    ({"input": "x", "previous_response_id": "resp_1"}, "unsupported_parameter", "body.previous_response_id"),
    ({"input": "x", "n": 2}, "unsupported_parameter", "body.n"),
    ({"input": "x", "metadata": {"run": 7}}, "invalid_parameter", "body.metadata"),  # echoed: strings, as OpenAI's
    ({"input": "x", "service_tier": "flex"}, "unsupported_parameter", "body.service_tier"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "unsupported_parameter", "body.tools"),
], ids=["empty", "image", "tool-output", "tool-role", "instructions", "zero-tokens", "over-cap", "format",
        "previous", "n", "metadata", "service-tier", "tools"])
def test_a_bad_responses_line_is_an_error_in_the_responses_names(tokenizer: Any, body: dict[str, Any], code: str,
                                                                   param: str) -> None:
    batch = parse(tokenizer, line("good", "/v1/responses", input="fine"), line("bad", "/v1/responses", **body))
    assert errors(batch) == [("bad", code, param)]
    assert "max_tokens " not in batch.errors[0].message and "body.messages" not in batch.errors[0].message


def test_a_responses_line_keeps_the_fields_that_change_no_output(tokenizer: Any) -> None:
    kept = {"service_tier": "auto", "prompt_cache_key": "k-1", "safety_identifier": "s-1", "user": "u-1",
            "store": True, "metadata": {"team": "docs"}}
    batch = parse(tokenizer, line("kept", "/v1/responses", input="Hi", temperature=0, **kept),
                  line("plain", "/v1/responses", input="Hi", temperature=0))
    assert batch.errors == []
    [with_fields, plain] = batch.requests
    assert (with_fields.prompt_ids, with_fields.max_tokens) == (plain.prompt_ids, plain.max_tokens)


def test_a_json_text_format_is_passed_on_as_chats_response_format(tokenizer: Any) -> None:
    # Given json_schema and json_object text formats (the Responses' flat shape)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    batch = parse(tokenizer, line("good", "/v1/responses", input="fine"),
                  line("json", "/v1/responses", input="x", text={"format": {"type": "json_schema", "name": "a",
                                                                             "schema": schema, "strict": True}}),
                  line("object", "/v1/responses", input="x", text={"format": {"type": "json_object"}}))
    # Then each line is served, carrying chat's response_format in chat's shape, and its text format to echo
    assert batch.errors == [] and [r.custom_id for r in batch.requests] == ["good", "json", "object"]
    [_, as_schema, as_object] = batch.requests
    assert as_schema.body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "a", "schema": schema, "strict": True}}
    assert as_schema.body["text"] == {"format": {"type": "json_schema", "name": "a", "schema": schema,
                                                 "strict": True}}
    assert as_object.body["response_format"] == {"type": "json_object"}
    # and a schema or name the chat path refuses is a line error naming where it is in the Responses' shape (the
    # json_schema's keys sit directly in text.format)
    bad = parse(tokenizer, line("good", "/v1/responses", input="fine"),
                line("schema", "/v1/responses", input="x", text={"format": {"type": "json_schema", "name": "a",
                                                                             "schema": {"type": "strng"}}}),
                line("name", "/v1/responses", input="x", text={"format": {"type": "json_schema", "name": "a b"}}))
    assert errors(bad) == [("schema", "invalid_parameter", "body.text.format.schema"),
                           ("name", "invalid_parameter", "body.text.format.name")]
    assert all("json_schema" not in e.message and "response_format" not in e.message for e in bad.errors)


# ---- the model's embedding recipe -----------------------------------------------------------------------------------
def write_modules(root: Path, flags: dict[str, bool], *, normalize: bool) -> Path:
    modules = [{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (root / "1_Pooling").mkdir(parents=True)
    (root / "modules.json").write_text(json.dumps(modules))
    (root / "1_Pooling" / "config.json").write_text(json.dumps(flags))
    return root


@pytest.mark.parametrize(("flag", "mode"), [("pooling_mode_mean_tokens", PoolingMode.mean),
                                            ("pooling_mode_cls_token", PoolingMode.cls),
                                            ("pooling_mode_lasttoken", PoolingMode.lasttoken)])
def test_the_pooling_mode_and_normalize_module_are_read_from_sentence_transformers_files(
        tmp_path: Path, flag: str, mode: PoolingMode) -> None:
    pooling = read_pooling(write_modules(tmp_path, {flag: True, "pooling_mode_max_tokens": False}, normalize=False))
    assert (pooling.mode, pooling.normalize, pooling.matryoshka) == (mode, False, None)


def test_a_pooling_mode_we_do_not_run_refuses_the_model_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="pooling must be exactly one of mean, cls or lasttoken"):
        read_pooling(write_modules(tmp_path, {"pooling_mode_max_tokens": True}, normalize=True))


def test_matryoshka_sizes_come_from_the_config(tmp_path: Path) -> None:
    class Config:
        matryoshka_dimensions = [64, 16, 32]
    assert read_pooling(tmp_path, Config()).matryoshka == (16, 32, 64)
    assert Pooling(matryoshka=()).dimensions_problem(10, 64) is None
    assert Pooling(matryoshka=()).dimensions_problem(65, 64) is not None
    assert Pooling(matryoshka=(16, 32)).dimensions_problem(64, 64) is None  # the full size, always
    assert Pooling(matryoshka=(16, 32)).dimensions_problem(24, 64) is not None


