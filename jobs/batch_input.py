"""Parse and validate an OpenAI-batch-format JSONL input file, line by line, into requests ready to store.

Each non-empty line is `{"custom_id", "method": "POST", "url", "body"}`. A bad line becomes a `LineError`
with a stable code and the parameter at fault (`param`, like OpenAI's batch errors); good lines go on. Codes:
invalid_json, missing_custom_id, invalid_custom_id, duplicate_custom_id, invalid_method, invalid_url,
invalid_body, model_mismatch, missing_prompt, missing_messages, invalid_messages, chat_template_missing,
invalid_parameter, unsupported_parameter, max_tokens_too_large, context_length_exceeded.

Defaults of omitted (or null) body parameters: max_tokens 256 (lowered to the cap and to what the model's
context leaves after the prompt), temperature 0.0 (greedy decoding, unlike OpenAI's 1.0), top_p 1.0,
seed 0, stop [], n 1 (up to MAX_CHOICES choices, each sampled with a seed of its own), no logprobs.
`max_completion_tokens` is an alias of `max_tokens` (which wins when both are given).
No parameter is silently ignored: a body key this service does not honour (`tools`, `response_format`,
`logit_bias`, `presence_penalty`…) is an `unsupported_parameter` line error naming it, unless its value is the one
that changes nothing (`stream: false`, `presence_penalty: 0`, `tools: []`…; see NEUTRAL_VALUES). `user` is kept
(it names the caller's end user and changes no output).

A prompt too long for the context by its character count alone is refused (context_length_exceeded) before it is
tokenized: tokenizing costs about 1 s and 160 MB of memory per million characters, so a 100 MB line would
otherwise take minutes and gigabytes to refuse. See `max_chars_per_token` for why the bound refuses no prompt
that would fit.
"""
from __future__ import annotations

import codecs
import json
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
URLS = (COMPLETIONS_URL, CHAT_URL)
ROLES = ("system", "user", "assistant")
DEFAULT_MAX_TOKENS = 256
MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 16  # n: each choice is a request of its own, generated (and resumed) on its own
MAX_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS = 20, 5  # OpenAI's bounds: chat top_logprobs, completions logprobs
SEED_LIMIT = 2**63
MAX_CUSTOM_ID_CHARS = 500  # jobs.models.Request.custom_id is String(500)
SUMMARIZED_ERRORS = 3
SHOWN_VALUE_CHARS = 60


@dataclass(frozen=True)
class InputLimits:
    """What one input file may hold; `context_length` is the model's max_position_embeddings."""

    max_file_bytes: int
    max_lines: int
    max_tokens_cap: int
    context_length: int


@dataclass(frozen=True)
class ParsedRequest:
    """One good line, ready to become a jobs.models.Request row."""

    line_number: int
    custom_id: str
    url: str
    body: dict[str, Any]
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: list[str]
    n: int = 1  # choices: the line becomes n requests (jobs.store.request_rows), its response has n choices
    top_logprobs: int | None = None  # logprobs asked: None for none, else how many likely tokens with each one


@dataclass(frozen=True)
class LineError:
    """One bad line: its 1-based number, its custom_id when known, a stable code and a one-line reason."""

    line_number: int
    custom_id: str | None
    code: str
    message: str
    param: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """`{"line_number", "custom_id", "code", "message", "param"}`, as stored in Job.line_errors."""
        return asdict(self)


@dataclass(frozen=True)
class ParsedBatch:
    """The good requests, the line errors, and the endpoint most good lines use."""

    requests: list[ParsedRequest]
    errors: list[LineError]
    endpoint: str


class BatchFileRejected(Exception):
    """Raised when the whole file is refused (nothing is created); the one-line message says what to do."""


class _LineProblem(Exception):
    """Raised inside the line checks: a stable code and a one-line reason."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@dataclass(frozen=True)
class _Context:
    """What every line is checked against."""

    tokenizer: Any
    model_name: str
    limits: InputLimits
    chars_per_token: int | None  # max_chars_per_token(tokenizer)
    endpoint: str | None         # the batch's endpoint (OpenAI's `endpoint`): every line's url must be it


def parse_batch_file(data: bytes, *, tokenizer: Any, model_name: str, limits: InputLimits,
                     endpoint: str | None = None) -> ParsedBatch:
    """Check every line: good ones become requests, bad ones errors; raise BatchFileRejected to refuse the file.

    With an `endpoint` (OpenAI's batches.create), a line whose url is another one is an error, as with OpenAI.
    """
    context = _Context(tokenizer, model_name, limits, max_chars_per_token(tokenizer), endpoint)
    requests: list[ParsedRequest] = []
    errors: list[LineError] = []
    seen: dict[str, int] = {}
    for number, text in _split_lines(data, limits):
        outcome = _parse_line(number, text, context, seen)
        if isinstance(outcome, ParsedRequest):
            requests.append(outcome)
        else:
            errors.append(outcome)
    if not requests:
        raise BatchFileRejected(_no_valid_request(errors))
    return ParsedBatch(requests, errors, endpoint or _main_endpoint(requests))


def batch_model(data: bytes) -> str | None:
    """The model a batch file names: the first `body.model` found on its lines (None when no line names one).

    One batch runs one model, as with OpenAI: parse_batch_file then makes every line naming another a line error.
    """
    for raw in data.removeprefix(codecs.BOM_UTF8).split(b"\n"):
        try:
            line = json.loads(raw) if raw.strip() else None
        except (ValueError, RecursionError):
            continue
        body = line.get("body") if isinstance(line, dict) else None
        if isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"]:
            return str(body["model"])
    return None


def _split_lines(data: bytes, limits: InputLimits) -> list[tuple[int, str]]:
    """The non-empty lines with their 1-based numbers, after the whole-file checks."""
    if len(data) > limits.max_file_bytes:
        raise BatchFileRejected(f"the input file is {len(data)} bytes; the limit is {limits.max_file_bytes} "
                                f"(SWARMBATCH_MAX_FILE_BYTES); split it into smaller files")
    lines = [(n, line) for n, line in enumerate(_decode(data).split("\n"), start=1) if line.strip()]
    if len(lines) > limits.max_lines:
        raise BatchFileRejected(f"the input file has {len(lines)} non-empty lines; the limit is {limits.max_lines} "
                                f"(SWARMBATCH_MAX_LINES); split it into smaller files")
    return lines


def _decode(data: bytes) -> str:
    """The file as text (a leading UTF-8 BOM is dropped), or BatchFileRejected naming the first bad byte's line."""
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise BatchFileRejected(f"the input file is not valid UTF-8 (line {line}, byte {exc.start}); "
                                f"save it as UTF-8 and submit it again") from None


def _parse_line(number: int, text: str, context: _Context, seen: dict[str, int]) -> ParsedRequest | LineError:
    """One line as a request, or as the first problem found in it."""
    custom_id: str | None = None
    try:
        line = _load_object(text)
        custom_id = _custom_id(line)
        _claim(custom_id, number, seen)
        return _parse_request(number, custom_id, line, context)
    except _LineProblem as problem:
        return LineError(number, custom_id, problem.code, problem.message, problem.param)


def _load_object(text: str) -> dict[str, Any]:
    """The line's JSON object (NaN and Infinity are refused: they are not JSON)."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise _LineProblem("invalid_json", f"not valid JSON: {exc.msg} at column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:
        raise _LineProblem("invalid_json", f"not valid JSON: {_one_line(exc)}") from None
    if not isinstance(value, dict):
        raise _LineProblem("invalid_json", f"a line must be a JSON object, not {_json_type(value)}")
    return value


def _refuse_constant(name: str) -> Any:
    """json.loads hook: NaN, Infinity and -Infinity are not JSON."""
    raise ValueError(f"{name} is not a JSON value")


def _custom_id(line: dict[str, Any]) -> str:
    """The line's custom_id: a non-empty string that fits the requests table."""
    value = line.get("custom_id")
    if not isinstance(value, str) or not value:
        raise _LineProblem("missing_custom_id", f"custom_id must be a non-empty string (got {_show(value)})",
                          "custom_id")
    if len(value) > MAX_CUSTOM_ID_CHARS:
        raise _LineProblem("invalid_custom_id", f"custom_id is {len(value)} characters; "
                                                f"the limit is {MAX_CUSTOM_ID_CHARS}", "custom_id")
    return value


def _claim(custom_id: str, number: int, seen: dict[str, int]) -> None:
    """Remember the custom_id, or refuse it if an earlier line used it."""
    if custom_id in seen:
        raise _LineProblem("duplicate_custom_id", f"custom_id {_show(custom_id)} is already used on line "
                                                  f"{seen[custom_id]}; each line needs its own", "custom_id")
    seen[custom_id] = number


def _parse_request(number: int, custom_id: str, line: dict[str, Any], context: _Context) -> ParsedRequest:
    """The checked request of one line whose custom_id is known."""
    url = _url(line, context.endpoint)
    body = _body(line, context.model_name)
    _refuse_unsupported(body, url)
    prompt = _messages(body) if url == CHAT_URL else _prompt(body)
    requested = _requested_max_tokens(body, context.limits.max_tokens_cap)
    sampling = (_temperature(body), _top_p(body), _seed(body), _stop(body))
    text = _chat_text(prompt, context.tokenizer) if isinstance(prompt, list) else prompt
    _refuse_beyond_context(len(text), requested, context)
    prompt_ids = _prompt_ids(text, context.tokenizer, chat=isinstance(prompt, list))
    max_tokens = _fit_max_tokens(requested, len(prompt_ids), context.limits)
    return ParsedRequest(number, custom_id, url, body, prompt_ids, max_tokens, *sampling, n=_choices(body),
                         top_logprobs=_top_logprobs(body, url))


def _url(line: dict[str, Any], endpoint: str | None) -> str:
    """The line's endpoint (the batch's, when it has one), after checking the method is POST."""
    method = line.get("method")
    if method != "POST":
        raise _LineProblem("invalid_method", f'method must be "POST" (got {_show(method)})', "method")
    url = line.get("url")
    if url not in URLS:
        raise _LineProblem("invalid_url", f"url must be {COMPLETIONS_URL} or {CHAT_URL} (got {_show(url)})",
                          "url")
    if endpoint is not None and url != endpoint:
        raise _LineProblem("invalid_url", f"url is {url} but the batch's endpoint is {endpoint}; every line of a "
                                          f"batch uses its endpoint", "url")
    return str(url)


def _body(line: dict[str, Any], model_name: str) -> dict[str, Any]:
    """The line's body object; its `model`, when given, must be the job's model."""
    body = line.get("body")
    if not isinstance(body, dict):
        raise _LineProblem("invalid_body", f"body must be a JSON object, not {_json_type(body)}", "body")
    model = body.get("model")
    if model is not None and model != model_name:
        raise _LineProblem("model_mismatch", f"body.model is {_show(model)} but this job runs {_show(model_name)}; "
                                             f"one batch runs one model: send these lines in a batch of their own",
                          "body.model")
    return body


# body keys honoured by endpoint (`user` names the caller's end user: kept, it changes no output)
COMMON_KEYS = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "user", "n"}
BODY_KEYS = {CHAT_URL: COMMON_KEYS | {"messages", "logprobs", "top_logprobs"},
             COMPLETIONS_URL: COMMON_KEYS | {"prompt", "logprobs"}}
# parameters we do not honour, accepted only with the value that asks for nothing (null is accepted for any key)
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "stream": (False,), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
    "tools": ([],), "functions": ([],), "tool_choice": ("none",),
    "function_call": ("none",), "response_format": ({"type": "text"},), "echo": (False,), "best_of": (1,),
    "suffix": ("",), "parallel_tool_calls": (False, True),
}


def _refuse_unsupported(body: dict[str, Any], url: str) -> None:
    """unsupported_parameter for the first body key this service would otherwise ignore (in the body's order)."""
    for key, value in body.items():
        if key in BODY_KEYS[url] or value is None or _is_neutral(key, value):
            continue
        raise _LineProblem("unsupported_parameter", f"body.{key} is not supported by this service (got "
                                                    f"{_show(value)}); remove it, or send the value that changes "
                                                    f"nothing", f"body.{key}")


def _is_neutral(key: str, value: Any) -> bool:
    """Whether `value` is what leaves `key` without effect (a bool never stands for a number, nor 1 for True)."""
    return any(_kind(value) == _kind(neutral) and value == neutral for neutral in NEUTRAL_VALUES.get(key, ()))


def _kind(value: Any) -> str:
    """A JSON value's kind: 0 and 0.0 are one number, and neither is false."""
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__


def _prompt(body: dict[str, Any]) -> str:
    """The completion prompt: a non-empty string."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise _LineProblem("missing_prompt", f"body.prompt must be a non-empty string for {COMPLETIONS_URL} "
                                             f"(got {_show(prompt)})", "body.prompt")
    return prompt


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """The chat messages, reduced to their role and content."""
    messages = body.get("messages")
    if messages is None or messages == []:
        raise _LineProblem("missing_messages", f"body.messages must be a non-empty list of "
                                               f"{{role, content}} for {CHAT_URL}", "body.messages")
    if not isinstance(messages, list):
        raise _LineProblem("invalid_messages", f"body.messages must be a list, not {_json_type(messages)}",
                          "body.messages")
    return [_message(index, message) for index, message in enumerate(messages)]


def _message(index: int, message: Any) -> dict[str, str]:
    """One chat message: a system, user or assistant role and a non-empty string content."""
    if not isinstance(message, dict):
        raise _LineProblem("invalid_messages", f"messages[{index}] must be an object, not {_json_type(message)}")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise _LineProblem("invalid_messages", f"messages[{index}].role must be one of {', '.join(ROLES)} "
                                               f"(got {_show(role)})")
    if not isinstance(content, str) or not content:
        raise _LineProblem("invalid_messages", f"messages[{index}].content must be a non-empty string "
                                               f"(got {_show(content)})")
    return {"role": str(role), "content": content}


def _requested_max_tokens(body: dict[str, Any], cap: int) -> int | None:
    """max_tokens (or its alias max_completion_tokens) as asked, None when omitted."""
    name = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise _invalid(name, "an integer >= 1", value)
    if value > cap:
        raise _LineProblem("max_tokens_too_large", f"{name} is {value}; the limit is {cap} "
                                                   f"(SWARMBATCH_MAX_TOKENS_CAP); ask for fewer tokens",
                          f"body.{name}")
    return int(value)


def _refuse_beyond_context(chars: int, requested: int | None, context: _Context) -> None:
    """context_length_exceeded, without tokenizing, for a prompt whose length in characters alone cannot fit."""
    if context.chars_per_token is None:
        return
    least_prompt = -(-chars // context.chars_per_token)
    least_output = requested if requested is not None else 1  # an omitted max_tokens is lowered, but to 1 at least
    if least_prompt + least_output > context.limits.context_length:
        output = f"max_tokens is {requested}" if requested is not None else "at least 1 token must be generated"
        raise _LineProblem("context_length_exceeded",
                           f"the prompt is {chars} characters, so at least {least_prompt} tokens (a token of this "
                           f"model covers at most {context.chars_per_token} characters), and {output}, but the "
                           f"model's context is {context.limits.context_length} tokens; shorten the prompt")


def _fit_max_tokens(requested: int | None, prompt_tokens: int, limits: InputLimits) -> int:
    """The max_tokens to store: as asked, or the default lowered to fit; the total must fit the context."""
    room = limits.context_length - prompt_tokens
    max_tokens = requested if requested is not None else max(1, min(DEFAULT_MAX_TOKENS, limits.max_tokens_cap, room))
    if prompt_tokens + max_tokens > limits.context_length:
        raise _LineProblem("context_length_exceeded",
                           f"the prompt is {prompt_tokens} tokens and max_tokens is {max_tokens}, "
                           f"{prompt_tokens + max_tokens} in all, but the model's context is "
                           f"{limits.context_length} tokens; shorten the prompt or lower max_tokens")
    return max_tokens


def _temperature(body: dict[str, Any]) -> float:
    """temperature in [0, 2]; 0.0 (greedy) when omitted."""
    return _number(body, "temperature", 0.0, lambda v: 0 <= v <= 2, "a number from 0 to 2")


def _top_p(body: dict[str, Any]) -> float:
    """top_p in (0, 1]; 1.0 when omitted."""
    return _number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "a number greater than 0 and at most 1")


def _number(body: dict[str, Any], name: str, default: float, valid: Callable[[float], bool], rule: str) -> float:
    """A numeric body parameter, checked by `valid`."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not valid(value):
        raise _invalid(name, rule, value)
    return float(value)


def _choices(body: dict[str, Any]) -> int:
    """n: how many choices to generate, 1 to MAX_CHOICES; 1 when omitted."""
    value = body.get("n")
    if value is None:
        return 1
    if not _is_int(value) or not 1 <= value <= MAX_CHOICES:
        raise _invalid("n", f"an integer from 1 to {MAX_CHOICES}", value)
    return int(value)


def _top_logprobs(body: dict[str, Any], url: str) -> int | None:
    """The logprobs asked, as OpenAI takes them: chat `logprobs: true` with `top_logprobs` 0 to 20; completions
    `logprobs` 0 to 5 (the chosen token's and that many likely tokens'). None when not asked."""
    if url == COMPLETIONS_URL:
        value = body.get("logprobs")
        if value is not None and (not _is_int(value) or not 0 <= value <= MAX_COMPLETION_LOGPROBS):
            raise _invalid("logprobs", f"an integer from 0 to {MAX_COMPLETION_LOGPROBS}", value)
        return value
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise _invalid("logprobs", "true or false", asked)
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise _invalid("top_logprobs", f"an integer from 0 to {MAX_TOP_LOGPROBS}", top)
    if top is not None and not asked:
        raise _LineProblem("invalid_parameter", "body.top_logprobs needs body.logprobs set to true",
                           "body.top_logprobs")
    return (top or 0) if asked else None


def _seed(body: dict[str, Any]) -> int:
    """seed: an integer in [0, 2**63); 0 when omitted."""
    value = body.get("seed")
    if value is None:
        return 0
    if not _is_int(value) or not 0 <= value < SEED_LIMIT:
        raise _invalid("seed", "an integer from 0 to 2**63 - 1", value)
    return int(value)


def _stop(body: dict[str, Any]) -> list[str]:
    """stop: a string or a list of up to 4 non-empty strings; [] when omitted."""
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    valid = isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)
    if not valid or len(stops) > MAX_STOP_SEQUENCES:
        raise _invalid("stop", f"a non-empty string or a list of up to {MAX_STOP_SEQUENCES} non-empty strings", value)
    return list(stops)


def _prompt_ids(text: str, tokenizer: Any, *, chat: bool) -> list[int]:
    """The prompt's token ids: a completion prompt as the tokenizer encodes it, a rendered chat template as it is."""
    if chat:
        return [int(i) for i in tokenizer(text, add_special_tokens=False).input_ids]
    ids = [int(i) for i in tokenizer(text).input_ids]
    if not ids:
        raise _LineProblem("missing_prompt", "body.prompt encodes to no tokens")
    return ids


def _chat_text(messages: list[dict[str, str]], tokenizer: Any) -> str:
    """The messages rendered by the model's chat template, ready for the assistant's reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise _LineProblem("chat_template_missing", f"this model's tokenizer has no chat template; "
                                                    f"send the prompt as text to {COMPLETIONS_URL}")
    try:
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    except Exception as exc:  # a chat template is arbitrary Jinja that may raise on messages it refuses
        raise _LineProblem("invalid_messages", f"the model's chat template refused these messages: "
                                               f"{_one_line(exc)}") from None


def _invalid(name: str, rule: str, value: Any) -> _LineProblem:
    """The invalid_parameter problem for one body parameter."""
    return _LineProblem("invalid_parameter", f"body.{name} must be {rule} (got {_show(value)})", f"body.{name}")


def _is_int(value: Any) -> bool:
    """A JSON integer (booleans are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type."""
    names = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "an array", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    """A value as short one-line JSON, for messages."""
    text = json.dumps(value) if value is not None else "nothing"
    return text if len(text) <= SHOWN_VALUE_CHARS else text[:SHOWN_VALUE_CHARS - 3] + "..."


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(exc).split())[:200] or type(exc).__name__


def _no_valid_request(errors: list[LineError]) -> str:
    """The rejection message of a file without one good line, summarizing the first line errors."""
    if not errors:
        return "no valid request in the file: it has no non-empty line; put one JSON request on each line"
    shown = "; ".join(f"line {e.line_number}: {e.code}: {e.message}" for e in errors[:SUMMARIZED_ERRORS])
    more = f"; and {len(errors) - SUMMARIZED_ERRORS} more" if len(errors) > SUMMARIZED_ERRORS else ""
    return f"no valid request in the file; {shown}{more}; fix these lines and submit the file again"


def _main_endpoint(requests: list[ParsedRequest]) -> str:
    """The url most good lines use (on a tie, the first good line's)."""
    return Counter(r.url for r in requests).most_common(1)[0][0]


# ---- the characters one token can cover -------------------------------------------------------------------------
_CHARS_PER_TOKEN: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()
# normalizers and pre-tokenizers that never shorten or drop text (a Replace is checked separately)
_KEEPING_NORMALIZERS = {"Prepend", "Replace"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"}


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for, or None when the tokenizer guarantees no such bound.

    Why a prompt of C characters then has at least ceil(C / bound) tokens: a BPE tokenizer cuts the (normalized)
    text into pieces, each of them a vocabulary entry or an added token. A byte-level vocabulary spells a token one
    character per byte (a text character is 1 to 4 bytes), a SentencePiece one spells it one character per text
    character ("▁" for a space; a byte-fallback "<0xNN>" is longer than the one byte it stands for), and an added
    token matched in the text is its own content: so a token covers at most as many characters of the text as its
    entry has, and the longest entry bounds them all (13 for the tiny test model, 81 for SmolLM2). The bound holds
    only while every character is covered and the normalized text is no shorter than the prompt, hence None (every
    line is tokenized, as before) for: a model other than BPE (WordPiece and Unigram map a whole unknown word to
    one token), unknown characters fused into one token, a normalizer that may shorten text (NFC/NFKC composing,
    Strip, a Replace by something shorter), a pre-tokenizer that drops text (Whitespace, BertPreTokenizer, a Split
    that removes), an added token that swallows the whitespace next to it (lstrip/rstrip), or no Rust backend.
    tests/jobs/test_batch_input.py checks the bound against both tokenizers on adversarial text.
    """
    try:
        return _CHARS_PER_TOKEN[tokenizer]
    except (KeyError, TypeError):  # TypeError: not weakly referenceable; computed each time then
        pass
    bound = _chars_per_token_bound(tokenizer)
    try:
        _CHARS_PER_TOKEN[tokenizer] = bound
    except TypeError:
        pass
    return bound


def _chars_per_token_bound(tokenizer: Any) -> int | None:
    """max_chars_per_token, computed from the tokenizer's serialized pipeline."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    fused_unknowns = model.get("unk_token") is not None and model.get("fuse_unk") and not model.get("byte_fallback")
    added = spec.get("added_tokens") or []
    if model.get("type") != "BPE" or fused_unknowns or any(t.get("lstrip") or t.get("rstrip") for t in added) \
            or not _keeps_text(spec.get("normalizer"), "normalizers", _KEEPING_NORMALIZERS) \
            or not _keeps_text(spec.get("pre_tokenizer"), "pretokenizers", _KEEPING_PRE_TOKENIZERS):
        return None
    lengths = [len(entry) for entry in model.get("vocab") or {}] + [len(t.get("content", "")) for t in added]
    return max(lengths, default=0) or None


def _keeps_text(step: dict[str, Any] | None, members: str, keeping: set[str]) -> bool:
    """Whether a normalizer or pre-tokenizer (a Sequence of them included) never shortens or drops text."""
    if step is None:
        return True
    kind = step.get("type")
    if kind == "Sequence":
        return all(_keeps_text(member, members, keeping) for member in step.get(members) or [])
    if kind not in keeping or str(step.get("behavior", "")).lower() == "removed":
        return False
    if kind == "Replace":
        pattern = (step.get("pattern") or {}).get("String")
        return isinstance(pattern, str) and len(str(step.get("content", ""))) >= len(pattern)
    return True
