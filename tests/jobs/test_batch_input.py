"""Parsing an OpenAI-batch JSONL input file: good lines become requests, bad lines get a number, an id and a code."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jobs.batch_input import (
    BatchFileRejected,
    InputLimits,
    LineError,
    ParsedBatch,
    batch_model,
    max_chars_per_token,
    parse_batch_file,
)
from jobs.line_sampling import EXTRAS, sampling_extras
from swarmclient.textgen import load_tokenizer

MODEL = "tiny-llama"
LIMITS = InputLimits(max_file_bytes=100_000, max_lines=100, max_tokens_cap=512, context_length=2048)
BIG_FILES = InputLimits(max_file_bytes=100 * 1024 * 1024, max_lines=100, max_tokens_cap=512, context_length=2048)
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the main idea?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return load_tokenizer(tiny_model)


def completion(custom_id: str = "c1", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": "The city council voted", **body}}


def chat(custom_id: str = "m1", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": CHAT, **body}}


def jsonl(*lines: dict[str, Any] | str) -> bytes:
    return "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines).encode()


def parse(tokenizer: Any, data: bytes, limits: InputLimits = LIMITS) -> ParsedBatch:
    return parse_batch_file(data, tokenizer=tokenizer, model_name=MODEL, limits=limits)


def only_error(tokenizer: Any, bad: dict[str, Any] | str, limits: InputLimits = LIMITS) -> LineError:
    batch = parse(tokenizer, jsonl(completion("good"), bad), limits)
    assert [r.custom_id for r in batch.requests] == ["good"] and len(batch.errors) == 1
    return batch.errors[0]


def test_a_good_completions_line_is_tokenized_as_the_tokenizer_does_and_keeps_its_parameters(tokenizer: Any) -> None:
    line = completion(max_tokens=20, temperature=0.7, top_p=0.9, seed=42, stop=["\n", "END"], user="ignored")
    batch = parse(tokenizer, jsonl(line))
    [request] = batch.requests
    assert request.prompt_ids == tokenizer("The city council voted").input_ids
    assert (request.line_number, request.custom_id, request.url) == (1, "c1", "/v1/completions")
    assert request.body == line["body"]
    assert (request.max_tokens, request.temperature, request.top_p, request.seed, request.stop) == (
        20, 0.7, 0.9, 42, ["\n", "END"])
    assert batch.errors == [] and batch.endpoint == "/v1/completions"


def test_a_good_chat_line_is_tokenized_through_the_chat_template(tokenizer: Any) -> None:
    [request] = parse(tokenizer, jsonl(chat(max_completion_tokens=8, temperature=1.5))).requests
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert request.prompt_ids == tokenizer(text, add_special_tokens=False).input_ids
    assert (request.url, request.max_tokens, request.temperature) == ("/v1/chat/completions", 8, 1.5)


def test_omitted_parameters_default_to_256_tokens_sampled_as_openai_does_with_a_seed_drawn_per_line(
        tokenizer: Any) -> None:
    # Given two identical lines that omit every parameter
    line = {"method": "POST", "url": "/v1/completions", "body": {"prompt": "Hello"}}
    first, second = parse(tokenizer, jsonl({"custom_id": "a", **line}, {"custom_id": "b", **line})).requests
    # Then both sample at OpenAI's temperature 1 and top_p 1, each with a seed of its own
    assert (first.max_tokens, first.temperature, first.top_p, first.stop) == (256, 1.0, 1.0, [])
    assert (second.max_tokens, second.temperature, second.top_p, second.stop) == (256, 1.0, 1.0, [])
    assert first.seed != second.seed and all(0 <= r.seed < 2**63 for r in (first, second))


def test_null_parameters_take_the_defaults(tokenizer: Any) -> None:
    line = completion(max_tokens=None, temperature=None, top_p=None, seed=None, stop=None, model=None)
    [request] = parse(tokenizer, jsonl(line)).requests
    params = (request.max_tokens, request.temperature, request.top_p, request.stop)
    assert params == (256, 1.0, 1.0, []) and 0 <= request.seed < 2**63


def test_the_default_max_tokens_is_lowered_to_the_cap_and_to_the_room_the_context_leaves(tokenizer: Any) -> None:
    prompt_tokens = len(tokenizer("The city council voted").input_ids)
    small_cap = InputLimits(max_file_bytes=100_000, max_lines=100, max_tokens_cap=100, context_length=2048)
    small_context = InputLimits(max_file_bytes=100_000, max_lines=100, max_tokens_cap=512,
                                context_length=prompt_tokens + 10)
    assert parse(tokenizer, jsonl(completion()), small_cap).requests[0].max_tokens == 100
    assert parse(tokenizer, jsonl(completion()), small_context).requests[0].max_tokens == 10


def test_a_single_stop_string_becomes_a_one_item_list(tokenizer: Any) -> None:
    assert parse(tokenizer, jsonl(completion(stop="###"))).requests[0].stop == ["###"]


def test_max_tokens_wins_over_its_alias_max_completion_tokens(tokenizer: Any) -> None:
    assert parse(tokenizer, jsonl(completion(max_tokens=5, max_completion_tokens=9))).requests[0].max_tokens == 5


def test_a_file_mixing_good_and_bad_lines_reports_each_bad_line_and_keeps_every_good_line(tokenizer: Any) -> None:
    data = jsonl(completion("a"), "{broken", "", chat("b"), completion("a"), {"custom_id": "c", "method": "GET"},
                 completion("d", temperature=5), "   ", chat("e"))
    batch = parse(tokenizer, data)
    assert [(r.line_number, r.custom_id) for r in batch.requests] == [(1, "a"), (4, "b"), (9, "e")]
    assert [(e.line_number, e.custom_id, e.code) for e in batch.errors] == [
        (2, None, "invalid_json"), (5, "a", "duplicate_custom_id"), (6, "c", "invalid_method"),
        (7, "d", "invalid_parameter")]
    assert "line 1" in batch.errors[1].message


BAD_LINES = [
    ("invalid_json", "{not json"),
    ("invalid_json", "[1, 2]"),
    ("invalid_json", '{"custom_id": "x", "body": {"temperature": NaN}}'),
    ("missing_custom_id", {**completion(), "custom_id": None}),
    ("missing_custom_id", {**completion(), "custom_id": 7}),
    ("missing_custom_id", {**completion(), "custom_id": ""}),
    ("invalid_custom_id", {**completion(), "custom_id": "x" * 501}),
    ("duplicate_custom_id", completion("good")),
    ("invalid_method", {**completion(), "method": "GET"}),
    ("invalid_method", {k: v for k, v in completion().items() if k != "method"}),
    ("invalid_url", {**completion(), "url": "/v1/audio/speech"}),
    ("invalid_body", {**completion(), "body": "prompt"}),
    ("model_mismatch", completion(model="gpt-4o")),
    ("missing_prompt", {**completion(), "body": {"model": MODEL}}),
    ("missing_prompt", completion(prompt="")),
    ("missing_prompt", completion(prompt=["a", "b"])),
    ("missing_messages", {**chat(), "body": {"model": MODEL}}),
    ("missing_messages", chat(messages=[])),
    ("invalid_messages", chat(messages="hello")),
    ("invalid_messages", chat(messages=["hello"])),
    ("invalid_messages", chat(messages=[{"role": "tool", "content": "x"}])),
    ("invalid_messages", chat(messages=[{"role": "user", "content": ""}])),
    ("invalid_messages", chat(messages=[{"role": "user", "content": [{"type": "text"}]}])),
    ("invalid_messages", chat(messages=[{"role": "user", "content": ["x"]}])),
    ("invalid_messages", chat(messages=[{"role": "user", "content": []}])),
    ("unsupported_content", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])),
    ("invalid_parameter", completion(max_tokens=0)),
    ("invalid_parameter", completion(max_tokens=2.5)),
    ("invalid_parameter", completion(max_tokens=True)),
    ("invalid_parameter", completion(max_completion_tokens="10")),
    ("invalid_parameter", completion(temperature=2.5)),
    ("invalid_parameter", completion(temperature=-0.1)),
    ("invalid_parameter", completion(temperature="hot")),
    ("invalid_parameter", completion(top_p=0)),
    ("invalid_parameter", completion(top_p=1.5)),
    ("invalid_parameter", completion(seed=-1)),
    ("invalid_parameter", completion(seed=2**63)),
    ("invalid_parameter", completion(seed=1.5)),
    ("invalid_parameter", completion(stop=["a", "b", "c", "d", "e"])),
    ("invalid_parameter", completion(stop=[""])),
    ("invalid_parameter", completion(stop="")),
    ("invalid_parameter", completion(stop=5)),
    ("invalid_parameter", completion(frequency_penalty=2.5)),
    ("invalid_parameter", completion(presence_penalty="high")),
    ("invalid_parameter", completion(repetition_penalty=0)),
    ("invalid_parameter", completion(top_k=-2)),
    ("invalid_parameter", completion(top_k=1.5)),
    ("invalid_parameter", completion(min_p=1.5)),
    ("invalid_parameter", completion(logit_bias=[1, 2])),
    ("invalid_parameter", completion(logit_bias={"word": 1})),
    ("invalid_parameter", completion(logit_bias={"5": 101})),
    ("invalid_parameter", completion(logit_bias={"99999": 1})),
    ("max_tokens_too_large", completion(max_tokens=513)),
    ("max_tokens_too_large", completion(max_completion_tokens=10_000)),
    ("context_length_exceeded", completion(prompt="word " * 2000, max_tokens=100)),
]


@pytest.mark.parametrize(("code", "bad"), BAD_LINES, ids=[f"{code}-{i}" for i, (code, _) in enumerate(BAD_LINES)])
def test_each_bad_line_is_reported_with_its_number_custom_id_and_code(tokenizer: Any, code: str,
                                                                       bad: dict[str, Any] | str) -> None:
    error = only_error(tokenizer, bad)
    expected_id = bad.get("custom_id") if isinstance(bad, dict) else None
    assert (error.line_number, error.code) == (2, code)
    assert error.custom_id == (expected_id if isinstance(expected_id, str) and 0 < len(expected_id) <= 500 else None)
    assert error.message and "\n" not in error.message


def test_a_model_mismatch_names_both_models(tokenizer: Any) -> None:
    message = only_error(tokenizer, completion("x", model="gpt-4o")).message
    assert "gpt-4o" in message and MODEL in message


def test_a_too_large_max_tokens_names_the_cap(tokenizer: Any) -> None:
    assert "512" in only_error(tokenizer, completion("x", max_tokens=1000)).message


def test_an_invalid_parameter_names_the_parameter(tokenizer: Any) -> None:
    assert "top_p" in only_error(tokenizer, completion("x", top_p=2)).message


def test_context_length_exceeded_gives_the_prompt_and_max_tokens_and_the_context(tokenizer: Any) -> None:
    prompt_tokens = len(tokenizer("The city council voted").input_ids)
    limits = InputLimits(max_file_bytes=100_000, max_lines=100, max_tokens_cap=512, context_length=prompt_tokens + 4)
    error = only_error(tokenizer, completion("x", max_tokens=5), limits)
    assert error.code == "context_length_exceeded"
    assert all(str(n) in error.message for n in (prompt_tokens, 5, prompt_tokens + 5, prompt_tokens + 4))


def test_a_chat_line_for_a_model_without_a_chat_template_says_to_use_completions(tiny_model: Path) -> None:
    plain = load_tokenizer(tiny_model)
    plain.chat_template = None
    error = only_error(plain, chat("x"))
    assert error.code == "chat_template_missing" and "/v1/completions" in error.message


def test_messages_the_chat_template_refuses_are_invalid_messages(tiny_model: Path) -> None:
    strict = load_tokenizer(tiny_model)
    strict.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    error = only_error(strict, chat("x"))
    assert error.code == "invalid_messages" and "no system role" in error.message


def test_a_line_error_serializes_to_a_plain_dict() -> None:
    error = LineError(3, "x", "invalid_url", "url must be ...")
    assert error.to_dict() == {"line_number": 3, "custom_id": "x", "code": "invalid_url", "message": "url must be ...",
                               "param": None}


def test_the_endpoint_is_the_url_most_good_lines_use(tokenizer: Any) -> None:
    assert parse(tokenizer, jsonl(completion("a"), chat("b"), chat("c"))).endpoint == "/v1/chat/completions"
    assert parse(tokenizer, jsonl(chat("a"), completion("b"))).endpoint == "/v1/chat/completions"


def test_crlf_line_endings_and_a_utf8_bom_are_accepted(tokenizer: Any) -> None:
    data = b"\xef\xbb\xbf" + jsonl(completion("a"), completion("b")).replace(b"\n", b"\r\n") + b"\r\n"
    assert [r.custom_id for r in parse(tokenizer, data).requests] == ["a", "b"]


def test_a_file_over_the_size_limit_is_rejected_naming_both_sizes_and_the_setting(tokenizer: Any) -> None:
    data = jsonl(completion("a"))
    limits = InputLimits(max_file_bytes=len(data) - 1, max_lines=100, max_tokens_cap=512, context_length=2048)
    with pytest.raises(BatchFileRejected, match=rf"is {len(data)} bytes; the limit is {len(data) - 1} "
                                                r"\(SWARMBATCH_MAX_FILE_BYTES\)"):
        parse(tokenizer, data, limits)


def test_a_file_with_more_non_empty_lines_than_the_limit_is_rejected(tokenizer: Any) -> None:
    limits = InputLimits(max_file_bytes=100_000, max_lines=2, max_tokens_cap=512, context_length=2048)
    assert len(parse(tokenizer, jsonl(completion("a"), "", "", completion("b"), ""), limits).requests) == 2
    with pytest.raises(BatchFileRejected, match="3 non-empty lines; the limit is 2"):
        parse(tokenizer, jsonl(completion("a"), completion("b"), completion("c")), limits)


def test_a_file_that_is_not_utf8_is_rejected_naming_the_line(tokenizer: Any) -> None:
    data = jsonl(completion("a")) + b"\n" + json.dumps(completion("b")).encode("latin-1").replace(b"city", b"cit\xe9")
    with pytest.raises(BatchFileRejected, match=r"not valid UTF-8 \(line 2"):
        parse(tokenizer, data)


def test_a_file_without_one_good_line_is_rejected_summarizing_the_first_errors(tokenizer: Any) -> None:
    data = jsonl("{", completion("a", model="other"), "[]", completion("b", top_p=9), "nope")
    with pytest.raises(BatchFileRejected) as rejected:
        parse(tokenizer, data)
    message = str(rejected.value)
    assert message.startswith("no valid request in the file; line 1: invalid_json: ")
    assert "line 2: model_mismatch: " in message and "line 3: invalid_json: " in message
    assert "line 4" not in message and "and 2 more" in message and "\n" not in message


def test_an_empty_or_blank_file_is_rejected(tokenizer: Any) -> None:
    for data in (b"", b"\n  \n\r\n"):
        with pytest.raises(BatchFileRejected, match="no valid request in the file"):
            parse(tokenizer, data)


@pytest.mark.parametrize(("window", "seconds"), [("24h", 86400), ("90m", 5400), ("3600s", 3600), ("3600", 3600),
                                                 ("1.5h", 5400), ("168h", 7 * 86400)])
def test_a_completion_window_is_read_in_hours_minutes_or_seconds(window: str, seconds: int) -> None:
    from jobs.durations import parse_window

    assert parse_window(window) == seconds


@pytest.mark.parametrize("window", ["infh", "nanh", "1e300h", "99999999999h", "169h", "0s", "-1h", "24 hours", "h"])
def test_a_completion_window_beyond_seven_days_or_not_a_duration_is_invalid(window: str) -> None:
    from jobs.durations import parse_window
    from jobs.errors import InvalidJob

    with pytest.raises(InvalidJob, match="completion window"):
        parse_window(window)


# ---- a prompt too long by its characters is refused before it is tokenized -------------------------------------------
def test_a_ten_megabyte_prompt_is_refused_by_its_character_count_without_tokenizing_it(tokenizer: Any) -> None:
    huge = "The city council voted. " * 420_000  # 10 MB: ~10 s and 1.6 GB to tokenize

    error = only_error(tokenizer, completion("huge", prompt=huge), BIG_FILES)

    # the message counts characters, not tokens: only the cheap bound words it so, the tokenizer never ran
    assert (error.code, error.custom_id) == ("context_length_exceeded", "huge")
    assert f"the prompt is {len(huge)} characters" in error.message and "2048 tokens" in error.message


def test_chat_messages_too_long_for_the_context_are_refused_by_their_rendered_length(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "word " * 2_000_000}]

    error = only_error(tokenizer, chat("huge", messages=messages, max_tokens=4), BIG_FILES)

    assert error.code == "context_length_exceeded" and "characters" in error.message and "max_tokens is 4" in \
        error.message


def test_a_prompt_that_fits_by_its_characters_is_still_measured_in_tokens(tokenizer: Any) -> None:
    # 10,000 characters are at least 770 tokens of the tiny model: within 2048, so the tokenizer decides
    error = only_error(tokenizer, completion("long", prompt="word " * 2000, max_tokens=100))

    assert error.code == "context_length_exceeded" and "tokens and max_tokens is 100" in error.message


def adversarial_texts(tokenizer: Any) -> list[str]:
    """Texts that pack the most characters into the fewest tokens: each long vocabulary entry over and over."""
    vocab = tokenizer.get_vocab()
    longest = sorted(vocab, key=len, reverse=True)[:300]
    texts = [tokenizer.decode([vocab[entry]]) * 40 for entry in longest]
    specials = "".join(tokenizer.all_special_tokens) + "".join(str(t) for t in tokenizer.added_tokens_decoder.values())
    return texts + [specials * 40, "#" * 5000, "\n" + " " * 5000, "é" * 3000, "😀" * 2000, "日本語" * 1000,
                    " ".join(tokenizer.decode([vocab[entry]]) for entry in longest)]


def assert_bound_holds(tokenizer: Any) -> None:
    bound = max_chars_per_token(tokenizer)
    assert bound is not None
    for text in adversarial_texts(tokenizer):
        for ids in (tokenizer(text).input_ids, tokenizer(text, add_special_tokens=False).input_ids):
            assert len(ids) * bound >= len(text), (text[:80], len(ids), len(text), bound)


def test_no_text_has_fewer_tokens_than_its_characters_over_the_tiny_models_bound(tokenizer: Any) -> None:
    assert max_chars_per_token(tokenizer) == 13
    assert_bound_holds(tokenizer)


@pytest.mark.slow
def test_no_text_has_fewer_tokens_than_its_characters_over_smollm2s_bound(smollm2_model: Path) -> None:
    smollm2 = load_tokenizer(smollm2_model)
    assert max_chars_per_token(smollm2) == 81
    assert_bound_holds(smollm2)


@pytest.mark.parametrize("change", ["nfkc", "strip", "whitespace", "lstrip"])
def test_a_tokenizer_that_may_shorten_or_drop_text_gets_no_character_bound(tiny_model: Path, change: str) -> None:
    from tokenizers import AddedToken, normalizers, pre_tokenizers

    altered = load_tokenizer(tiny_model)
    backend = altered.backend_tokenizer
    if change == "nfkc":  # composes "e" + U+0301 into one character
        backend.normalizer = normalizers.NFKC()
    elif change == "strip":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("_"), normalizers.Strip()])
    elif change == "whitespace":  # drops every space
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
    else:  # "<mask>" would swallow the spaces before it
        backend.add_special_tokens([AddedToken("<mask>", lstrip=True)])

    assert max_chars_per_token(altered) is None
    # and so a long prompt is measured in tokens, as before
    assert "tokens and max_tokens" in only_error(altered, completion("x", prompt="word " * 2000)).message


# ---- parameters are never silently ignored ---------------------------------------------------------------------------
@pytest.mark.parametrize(("line", "param"), [
    (chat(tools=[{"type": "function", "function": {"name": "f"}}]), "body.tools"),
    (completion(response_format={"type": "json_object"}), "body.response_format"),  # chat's parameter, as at OpenAI
    (completion(suffix="end"), "body.suffix"),
    (chat(tool_choice="auto"), "body.tool_choice"),
    (completion(stream=True), "body.stream"),
    (completion(stream=0), "body.stream"),        # a number is not false
    (completion(best_of=3), "body.best_of"),
    (chat(frobnicate="yes"), "body.frobnicate"),  # a key OpenAI does not know either
    (chat(prompt="text"), "body.prompt"),         # the other endpoint's parameter
])
def test_a_parameter_the_service_does_not_honour_is_a_line_error_naming_it(tokenizer: Any, line: dict[str, Any],
                                                                          param: str) -> None:
    error = only_error(tokenizer, {**line, "custom_id": "bad"})
    assert (error.code, error.param, error.custom_id) == ("unsupported_parameter", param, "bad")
    assert param in error.message and "\n" not in error.message


def test_parameters_with_the_value_that_changes_nothing_are_accepted(tokenizer: Any) -> None:
    neutral = dict(n=1, stream=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, tools=[],
                   response_format={"type": "text"}, tool_choice=None, user="u-1", logprobs=False)
    batch = parse(tokenizer, jsonl(chat("a", **neutral)))
    assert batch.errors == [] and [r.custom_id for r in batch.requests] == ["a"]


def test_a_bad_parameter_names_itself_in_the_line_error(tokenizer: Any) -> None:
    assert only_error(tokenizer, completion("t", temperature=3)).param == "body.temperature"
    assert only_error(tokenizer, completion("m", model="other")).param == "body.model"
    assert only_error(tokenizer, {**completion("u"), "url": "/v1/audio/speech"}).param == "url"


def test_with_an_endpoint_a_line_of_the_other_url_is_an_error(tokenizer: Any) -> None:
    batch = parse_batch_file(jsonl(chat("a"), completion("b")), tokenizer=tokenizer, model_name=MODEL, limits=LIMITS,
                             endpoint="/v1/chat/completions")
    assert [r.custom_id for r in batch.requests] == ["a"] and batch.endpoint == "/v1/chat/completions"
    [error] = batch.errors
    assert (error.line_number, error.code, error.param) == (2, "invalid_url", "url")
    assert "/v1/chat/completions" in error.message


def test_the_model_of_a_batch_file_is_the_first_line_that_names_one() -> None:
    no_model = {"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}}
    assert batch_model(jsonl("{broken", no_model, completion("a", model="first"), completion("b", model="second"))) \
        == "first"
    assert batch_model(jsonl(no_model)) is None


def test_n_asks_for_that_many_choices_from_1_to_16(tokenizer: Any) -> None:
    [request] = parse(tokenizer, jsonl(completion(n=3))).requests
    assert request.n == 3 and parse(tokenizer, jsonl(completion())).requests[0].n == 1
    for bad in (0, 17, True, 2.5, "3"):
        error = only_error(tokenizer, completion("bad", n=bad))
        assert (error.code, error.param) == ("invalid_parameter", "body.n"), bad


def test_logprobs_are_asked_as_openai_asks_them(tokenizer: Any) -> None:
    def top(line: dict[str, Any]) -> int | None:
        return parse(tokenizer, jsonl(line)).requests[0].top_logprobs

    assert top(chat(logprobs=True, top_logprobs=3)) == 3 and top(chat(logprobs=True)) == 0
    assert top(chat(logprobs=False)) is None and top(chat()) is None
    assert top(completion(logprobs=2)) == 2 and top(completion(logprobs=0)) == 0 and top(completion()) is None


@pytest.mark.parametrize(("line", "code", "param"), [
    (chat(top_logprobs=2), "invalid_parameter", "body.top_logprobs"),             # without logprobs: true
    (chat(logprobs=True, top_logprobs=21), "invalid_parameter", "body.top_logprobs"),
    (chat(logprobs=1), "invalid_parameter", "body.logprobs"),
    (completion(logprobs=6), "invalid_parameter", "body.logprobs"),
    (completion(logprobs=True), "invalid_parameter", "body.logprobs"),
    (completion(top_logprobs=2), "unsupported_parameter", "body.top_logprobs"),  # chat's parameter
])
def test_bad_logprobs_are_line_errors_naming_the_parameter(tokenizer: Any, line: dict[str, Any], code: str,
                                                           param: str) -> None:
    error = only_error(tokenizer, {**line, "custom_id": "bad"})
    assert (error.code, error.param) == (code, param)


# ---- messages as OpenAI's docs write them; penalties; aliases ---------------------------------------------------------
def test_a_developer_message_is_rendered_as_a_system_message(tokenizer: Any) -> None:
    developer = [{"role": "developer", "content": CHAT[0]["content"]}, CHAT[1]]
    [as_developer, as_system] = parse(tokenizer, jsonl(chat("d", messages=developer), chat("s"))).requests
    assert as_developer.prompt_ids == as_system.prompt_ids


def test_text_parts_are_joined_with_newlines_as_one_content(tokenizer: Any) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the idea?"}]}]
    plain = [{"role": "user", "content": "What is\nthe idea?"}]
    [from_parts, from_text] = parse(tokenizer, jsonl(chat("p", messages=parts), chat("t", messages=plain))).requests
    assert from_parts.prompt_ids == from_text.prompt_ids


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "file-1"}}])
def test_an_image_audio_or_file_part_is_a_line_error_naming_the_part_type(tokenizer: Any, part: dict[str, Any]
                                                                          ) -> None:
    content = [{"type": "text", "text": "Describe this"}, part]
    error = only_error(tokenizer, chat("bad", messages=[{"role": "user", "content": content}]))
    assert (error.code, error.param) == ("unsupported_content", "body.messages[0].content[1].type")
    assert repr(part["type"]) in error.message and "text" in error.message


def test_penalties_and_extensions_are_accepted_and_read_back_from_the_stored_body(tokenizer: Any) -> None:
    line = completion(frequency_penalty=0.5, presence_penalty=-1, repetition_penalty=1.2, top_k=40, min_p=0.05,
                      logit_bias={"50": 5, "7": -100})
    [request] = parse(tokenizer, jsonl(line)).requests
    assert sampling_extras(request.body) == {"frequency_penalty": 0.5, "presence_penalty": -1.0,
                                             "repetition_penalty": 1.2, "top_k": 40, "min_p": 0.05,
                                             "logit_bias": ((7, -100.0), (50, 5.0))}
    assert sampling_extras({}) == {**EXTRAS, "logit_bias": ()}


@pytest.mark.parametrize("name", ["frequency_penalty", "presence_penalty", "repetition_penalty", "top_k", "min_p",
                                  "logit_bias"])
def test_a_bad_penalty_names_itself_in_the_line_error(tokenizer: Any, name: str) -> None:
    error = only_error(tokenizer, completion("bad", **{name: "x"}))
    assert (error.code, error.param) == ("invalid_parameter", f"body.{name}") and name in error.message


def test_a_line_may_name_the_model_by_an_alias_and_a_name_that_is_neither_is_a_line_error(tokenizer: Any) -> None:
    data = jsonl(completion("a", model="gpt-4o-mini"), completion("b", model=MODEL), completion("c", model="gpt-4o"))
    batch = parse_batch_file(data, tokenizer=tokenizer, model_name=MODEL, limits=LIMITS, model_aliases=["gpt-4o-mini"])
    assert [r.custom_id for r in batch.requests] == ["a", "b"]
    [error] = batch.errors
    assert (error.custom_id, error.code, error.param) == ("c", "model_mismatch", "body.model")
    assert '"gpt-4o"' in error.message and '"gpt-4o-mini"' in error.message


# ---- response_format: structured outputs -----------------------------------------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def json_schema(schema: Any = PERSON, **spec: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, **spec}}


def test_json_mode_and_json_schemas_are_accepted_and_kept_in_the_stored_body(tokenizer: Any) -> None:
    formats = [{"type": "json_object"}, json_schema(strict=True), json_schema(strict=False, description="a person"),
               json_schema(strict=None), {"type": "json_schema", "json_schema": {"name": "anything"}},
               json_schema({"type": "string", "format": "email"}, strict=True),
               json_schema({"type": "object", "not": {"required": ["x"]}}, strict=False)]  # `not` ignored: lenient
    batch = parse(tokenizer, jsonl(*(chat(f"f{i}", response_format=f) for i, f in enumerate(formats))))
    assert batch.errors == [] and [r.body["response_format"] for r in batch.requests] == formats


@pytest.mark.parametrize(("response_format", "param", "says"), [
    ({"type": "xml"}, "body.response_format", '"json_object" or "json_schema"'),
    ("json_object", "body.response_format", '"json_object" or "json_schema"'),
    ({"type": "json_object", "schema": PERSON}, "body.response_format.schema", "remove it"),
    ({"type": "json_schema"}, "body.response_format.json_schema", '{"name", "schema", "strict"}'),
    ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "body.response_format.json_schema.name", "letters"),
    (json_schema(strict="yes"), "body.response_format.json_schema.strict", "true or false"),
    (json_schema([PERSON]), "body.response_format.json_schema.schema", "a JSON Schema object"),
    (json_schema(strict=True, extra=1), "body.response_format.json_schema.extra", "remove it"),
    (json_schema({"type": "strng"}, strict=True), "body.response_format.json_schema.schema", "strng; fix the schema"),
    (json_schema({"type": "integer", "minimum": 5, "maximum": 2}), "body.response_format.json_schema.schema",
     "minimum (5) is greater than maximum (2)"),
    (json_schema({"$ref": "#/$defs/missing"}), "body.response_format.json_schema.schema", "does not exist"),
    (json_schema({"type": "string", "pattern": "(?=a)b"}), "body.response_format.json_schema.schema", "look-around"),
    (json_schema({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, strict=True),
     "body.response_format.json_schema.schema", '"if", "then"'),
])
def test_a_bad_response_format_or_a_schema_that_cannot_be_enforced_is_a_line_error_naming_it(
        tokenizer: Any, response_format: Any, param: str, says: str) -> None:
    error = only_error(tokenizer, chat("bad", response_format=response_format))
    assert (error.code, error.param, error.custom_id) == ("invalid_parameter", param, "bad")
    assert says in error.message and "\n" not in error.message, error.message


def test_a_strict_schema_using_keywords_that_cannot_be_enforced_says_to_drop_them_or_turn_strict_off(
        tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    error = only_error(tokenizer, chat("bad", response_format=json_schema(schema, strict=True)))
    assert error.message.endswith("remove those keywords, or set strict to false to have them ignored")
    assert parse(tokenizer, jsonl(chat("ok", response_format=json_schema(schema, strict=False)))).errors == []


# ---- fields of real OpenAI batch files that change no output; messages' other keys; tools ----------------------------
@pytest.mark.parametrize("field", [{"metadata": {"team": "docs", "run": "7"}}, {"service_tier": "auto"},
                                   {"service_tier": "default"}, {"modalities": ["text"]}, {"prompt_cache_key": "k-1"},
                                   {"safety_identifier": "user-hash-1"}, {"user": "u-1"}, {"store": True},
                                   {"store": False}, {"metadata": {}}],
                         ids=lambda field: "-".join(f"{k}={v}" for k, v in field.items()))
def test_a_field_that_changes_no_output_is_accepted_and_the_line_is_the_same_without_it(tokenizer: Any,
                                                                                      field: dict[str, Any]) -> None:
    batch = parse(tokenizer, jsonl(chat("with", temperature=0, **field), chat("without", temperature=0)))
    assert batch.errors == []
    [with_field, without] = batch.requests
    assert (with_field.prompt_ids, with_field.max_tokens, with_field.temperature) == (
        without.prompt_ids, without.max_tokens, without.temperature)
    assert {key: with_field.body[key] for key in field} == field


@pytest.mark.parametrize(("field", "code", "param"), [
    ({"modalities": ["text", "audio"]}, "unsupported_parameter", "body.modalities"),  # audio output changes it
    ({"modalities": ["audio"]}, "unsupported_parameter", "body.modalities"),
    ({"service_tier": "flex"}, "unsupported_parameter", "body.service_tier"),
    ({"service_tier": "priority"}, "unsupported_parameter", "body.service_tier"),
    ({"metadata": {"n": 1}}, "invalid_parameter", "body.metadata"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "invalid_parameter", "body.metadata"),
    ({"metadata": "team=docs"}, "invalid_parameter", "body.metadata"),
    ({"prompt_cache_key": 5}, "invalid_parameter", "body.prompt_cache_key"),
    ({"safety_identifier": {"id": 1}}, "invalid_parameter", "body.safety_identifier"),
    ({"user": 3}, "invalid_parameter", "body.user"),
], ids=["text-audio", "audio", "flex", "priority", "metadata-number", "metadata-17", "metadata-string",
        "cache-key", "safety", "user"])
def test_a_value_of_those_fields_that_would_change_the_output_or_is_malformed_is_a_line_error_naming_it(
        tokenizer: Any, field: dict[str, Any], code: str, param: str) -> None:
    error = only_error(tokenizer, chat("bad", **field))
    assert (error.code, error.param, error.custom_id) == (code, param, "bad")
    assert param in error.message and "\n" not in error.message


def test_completions_lines_do_not_take_chats_metadata(tokenizer: Any) -> None:
    error = only_error(tokenizer, completion("bad", metadata={"team": "docs"}))
    assert (error.code, error.param) == ("unsupported_parameter", "body.metadata")


NAMED = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "ada"}]
# a template that renders the names of user messages (as a multi-user chat model's may), not of others
NAME_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] }}"
                 "{% if message.name and message.role == 'user' %}{{ ' ' + message.name }}{% endif %}"
                 "{{ '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_message_name_the_chat_template_does_not_render_is_a_line_error_naming_it(tokenizer: Any) -> None:
    # the tiny model's template renders role and content only: the name would change nothing, so it is refused
    error = only_error(tokenizer, chat("named", messages=NAMED))
    assert (error.code, error.param) == ("invalid_messages", "body.messages[1].name")
    assert '"ada"' in error.message and "does not render" in error.message
    # a null name is no name
    nameless = [NAMED[0], {**NAMED[1], "name": None}]
    assert parse(tokenizer, jsonl(chat("null", messages=nameless))).errors == []


def test_a_message_name_is_given_to_a_chat_template_that_renders_it(tiny_model: Path) -> None:
    naming = load_tokenizer(tiny_model)
    naming.chat_template = NAME_TEMPLATE
    unnamed = [NAMED[0], {"role": "user", "content": "Hi"}]
    batch = parse(naming, jsonl(chat("named", messages=NAMED), chat("unnamed", messages=unnamed)))
    assert batch.errors == []
    [named, plain] = batch.requests
    assert naming.decode(named.prompt_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user ada\n")
    assert named.prompt_ids != plain.prompt_ids
    # and the name of a message whose role the template does not name is still refused
    error = only_error(naming, chat("system-named", messages=[{**NAMED[0], "name": "boss"}, NAMED[1]]))
    assert (error.code, error.param) == ("invalid_messages", "body.messages[0].name")
    error = only_error(naming, chat("empty-name", messages=[NAMED[0], {**NAMED[1], "name": ""}]))
    assert (error.code, error.param) == ("invalid_messages", "body.messages[1].name")


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "user", "content": "Hi", "weight": 1}, "body.messages[1].weight"),
    ({"role": "user", "content": "Hi", "audio": {"id": "a1"}}, "body.messages[1].audio"),
    ({"role": "assistant", "content": "Hi", "refusal": "no"}, "body.messages[1].refusal"),
], ids=["unknown", "audio", "refusal"])
def test_any_other_message_key_is_a_line_error_naming_it(tokenizer: Any, message: dict[str, Any], param: str
                                                         ) -> None:
    error = only_error(tokenizer, chat("bad", messages=[CHAT[0], message]))
    assert (error.code, error.param) == ("invalid_messages", param)
    assert param.rsplit(".", 1)[1] in error.message and "\n" not in error.message
    # null, as OpenAI's own outputs carry them (an assistant's refusal: null, tool_calls: []), changes nothing
    replayed = [CHAT[0], {"role": "assistant", "content": "Hello.", "refusal": None, "tool_calls": [],
                          "audio": None}, CHAT[1]]
    assert parse(tokenizer, jsonl(chat("ok", messages=replayed))).errors == []


@pytest.mark.parametrize(("line", "code", "param"), [
    (chat(tools=[{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]),
     "unsupported_parameter", "body.tools"),
    (chat(functions=[{"name": "lookup"}]), "unsupported_parameter", "body.functions"),
    (chat(tool_choice="required"), "unsupported_parameter", "body.tool_choice"),
    (chat(messages=[*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]}]),
     "invalid_messages", "body.messages[2].tool_calls"),
    (chat(messages=[*CHAT, {"role": "assistant", "content": "", "function_call": {"name": "lookup",
                                                                                   "arguments": "{}"}}]),
     "invalid_messages", "body.messages[2].function_call"),
    (chat(messages=[*CHAT, {"role": "tool", "tool_call_id": "call_1", "content": "42"}]),
     "invalid_messages", "body.messages[2].role"),
    (chat(messages=[*CHAT, {"role": "function", "name": "lookup", "content": "42"}]),
     "invalid_messages", "body.messages[2].role"),
], ids=["tools", "functions", "tool-choice", "tool-calls", "function-call", "tool-role", "function-role"])
def test_tool_calling_is_a_line_error_saying_in_one_line_that_this_service_does_not_support_it(
        tokenizer: Any, line: dict[str, Any], code: str, param: str) -> None:
    error = only_error(tokenizer, {**line, "custom_id": "tools"})
    assert (error.code, error.param, error.custom_id) == (code, param, "tools")
    assert "tool calling is not supported by this service" in error.message and "\n" not in error.message
