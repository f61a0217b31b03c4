"""Parse and validate an OpenAI-batch-format JSONL input file, line by line, into requests ready to store.

Each non-empty line is `{"custom_id", "method": "POST", "url", "body"}`. A bad line becomes a `LineError`
with a stable code and the parameter at fault (`param`, like OpenAI's batch errors); good lines go on. Codes:
invalid_json, missing_custom_id, invalid_custom_id, duplicate_custom_id, invalid_method, invalid_url,
invalid_body, model_mismatch, missing_prompt, missing_messages, invalid_messages, unsupported_content,
chat_template_missing, invalid_parameter, unsupported_parameter, max_tokens_too_large, context_length_exceeded,
missing_input, invalid_input (responses and embeddings lines: jobs.line_responses, jobs.line_embeddings).

A line's `body.model` may be the batch's model or any alias of it (SWARMBATCH_MODEL_ALIASES, resolved by the caller).
Messages (jobs.line_checks): roles system, developer (as system), user, assistant; content a string or text parts;
`name` where the model's chat template renders it (a line error where it does not: it would change nothing).
Defaults of omitted (or null) body parameters: max_tokens 256 (lowered to the cap and to what the model's
context leaves after the prompt); OpenAI's sampling defaults, temperature 1.0 and top_p 1.0 (send temperature 0
for greedy decoding); a seed drawn at random and stored with the request; stop [], n 1 (up to MAX_CHOICES choices,
each sampled with a seed of its own), no logprobs, no penalties (jobs.line_sampling: OpenAI's frequency_penalty,
presence_penalty, logit_bias; vLLM's top_k, min_p, repetition_penalty).
`max_completion_tokens` is an alias of `max_tokens` (which wins when both are given).
A chat line's `response_format` (json_object, json_schema: jobs.line_format) is checked, its schema compiled.
No parameter is silently ignored: a body key this service does not honour (`tools`, `functions`…) is an
`unsupported_parameter` line error naming it, unless its value is the one that changes nothing (`stream: false`,
`tools: []`, `service_tier: "auto"`, `modalities: ["text"]`…; see NEUTRAL_VALUES); tool keys say that tool calling
is not supported. Kept, as they change no output: `user`, `safety_identifier`, `prompt_cache_key` (strings) and a
chat line's `metadata` (jobs.line_checks.check_kept).

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
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Any

from jobs import line_embeddings, line_responses, line_sampling
from jobs.input_lines import BatchFileRejected, read_lines
from jobs.line_checks import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    NO_TOOLS,
    RESPONSES_URL,
    LineProblem,
    check_kept,
    invalid,
    is_int,
    json_type,
    messages,
    one_line,
    show,
)
from jobs.line_embeddings import EmbeddingModel
from jobs.line_format import check_response_format
from jobs.line_sampling import EXTRAS

URLS = (COMPLETIONS_URL, CHAT_URL, EMBEDDINGS_URL, RESPONSES_URL)
DEFAULT_MAX_TOKENS = 256
MAX_CUSTOM_ID_CHARS = 500  # jobs.models.Request.custom_id is String(500)
SUMMARIZED_ERRORS = 3


@dataclass(frozen=True)
class InputLimits:
    """What one input file may hold; `context_length` is the model's max_position_embeddings."""

    max_file_bytes: int
    max_lines: int
    max_tokens_cap: int
    context_length: int
    embedding: EmbeddingModel = field(default_factory=EmbeddingModel)  # what `/v1/embeddings` lines may ask


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
    inputs: list[list[int]] | None = None  # an embeddings line: each input's token ids (n of them, one request each)


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


@dataclass(frozen=True)
class _Context:
    """What every line is checked against."""

    tokenizer: Any
    model_name: str
    model_aliases: frozenset[str]  # other names a line's body.model may give the model (SWARMBATCH_MODEL_ALIASES)
    limits: InputLimits
    chars_per_token: int | None  # max_chars_per_token(tokenizer)
    endpoint: str | None         # the batch's endpoint (OpenAI's `endpoint`): every line's url must be it


def parse_batch_file(data: bytes, *, tokenizer: Any, model_name: str, limits: InputLimits,
                     endpoint: str | None = None, model_aliases: Collection[str] = ()) -> ParsedBatch:
    """Check every line: good ones become requests, bad ones errors; raise BatchFileRejected to refuse the file.

    With an `endpoint` (OpenAI's batches.create), a line whose url is another one is an error, as with OpenAI.
    """
    checker = LineChecker(tokenizer=tokenizer, model_name=model_name, limits=limits, endpoint=endpoint,
                          model_aliases=model_aliases)
    requests: list[ParsedRequest] = []
    errors: list[LineError] = []
    for line in read_lines(data, max_bytes=limits.max_file_bytes, max_lines=limits.max_lines):
        outcome = checker.check(line.number, line.text)
        if isinstance(outcome, ParsedRequest):
            requests.append(outcome)
        else:
            errors.append(outcome)
    if not requests:
        raise BatchFileRejected(_no_valid_request(errors), code="no_valid_request")
    main = endpoint or _main_endpoint(requests)
    requests, errors = _one_kind(requests, errors, main)
    return ParsedBatch(requests, errors, main)


class LineChecker:
    """Checks a file's lines in order, remembering the custom_ids used so far (`seen`: custom_id -> its line, given
    to resume a file part-way, as jobs.ingest does)."""

    def __init__(self, *, tokenizer: Any, model_name: str, limits: InputLimits, endpoint: str | None = None,
                 model_aliases: Collection[str] = (), seen: dict[str, int] | None = None) -> None:
        self.context = _Context(tokenizer, model_name, frozenset(model_aliases), limits,
                                max_chars_per_token(tokenizer), endpoint)
        self.seen = dict(seen or {})

    def check(self, number: int, text: str) -> ParsedRequest | LineError:
        """Line `number` as a request, or as the first problem found in it."""
        return _parse_line(number, text, self.context, self.seen)


def claims_custom_id(error: dict[str, Any]) -> bool:
    """Whether a stored line error's line still used its custom_id (a later line with the same one is a duplicate)."""
    return error.get("custom_id") is not None and error.get("code") != "duplicate_custom_id"


def batch_model(data: bytes) -> str | None:
    """The model a batch file names: the first `body.model` found on its lines (None when no line names one).

    One batch runs one model, as with OpenAI: parse_batch_file then makes every line naming another a line error.
    """
    for raw in data.removeprefix(codecs.BOM_UTF8).split(b"\n"):
        if (model := line_model(raw)) is not None:
            return model
    return None


def line_model(raw: str | bytes) -> str | None:
    """The `body.model` one line names, if it is a JSON object that names one."""
    try:
        line = json.loads(raw) if raw.strip() else None
    except (ValueError, RecursionError):
        return None
    body = line.get("body") if isinstance(line, dict) else None
    if isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"]:
        return str(body["model"])
    return None


def _parse_line(number: int, text: str, context: _Context, seen: dict[str, int]) -> ParsedRequest | LineError:
    """One line as a request, or as the first problem found in it."""
    custom_id: str | None = None
    try:
        line = _load_object(text)
        custom_id = _custom_id(line)
        _claim(custom_id, number, seen)
        return _parse_request(number, custom_id, line, context)
    except LineProblem as problem:
        return LineError(number, custom_id, problem.code, problem.message, problem.param)


def _load_object(text: str) -> dict[str, Any]:
    """The line's JSON object (NaN and Infinity are refused: they are not JSON)."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise LineProblem("invalid_json", f"not valid JSON: {exc.msg} at column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:
        raise LineProblem("invalid_json", f"not valid JSON: {one_line(exc)}") from None
    if not isinstance(value, dict):
        raise LineProblem("invalid_json", f"a line must be a JSON object, not {json_type(value)}")
    return value


def _refuse_constant(name: str) -> Any:
    """json.loads hook: NaN, Infinity and -Infinity are not JSON."""
    raise ValueError(f"{name} is not a JSON value")


def _custom_id(line: dict[str, Any]) -> str:
    """The line's custom_id: a non-empty string that fits the requests table."""
    value = line.get("custom_id")
    if not isinstance(value, str) or not value:
        raise LineProblem("missing_custom_id", f"custom_id must be a non-empty string (got {show(value)})",
                          "custom_id")
    if len(value) > MAX_CUSTOM_ID_CHARS:
        raise LineProblem("invalid_custom_id", f"custom_id is {len(value)} characters; "
                                                f"the limit is {MAX_CUSTOM_ID_CHARS}", "custom_id")
    return value


def _claim(custom_id: str, number: int, seen: dict[str, int]) -> None:
    """Remember the custom_id, or refuse it if an earlier line used it."""
    if custom_id in seen:
        raise LineProblem("duplicate_custom_id", f"custom_id {show(custom_id)} is already used on line "
                                                  f"{seen[custom_id]}; each line needs its own", "custom_id")
    seen[custom_id] = number


def _parse_request(number: int, custom_id: str, line: dict[str, Any], context: _Context) -> ParsedRequest:
    """The checked request of one line whose custom_id is known."""
    url = _url(line, context.endpoint)
    body = _body(line, context)
    _refuse_unsupported(body, url)
    check_kept(body)
    if url == EMBEDDINGS_URL:
        return _parse_embedding(number, custom_id, body, context)
    if url == RESPONSES_URL:
        return line_responses.as_responses(body, lambda chat: _parse_chat(number, custom_id, chat, context))
    return _parse_generation(number, custom_id, url, body, context)


def _parse_chat(number: int, custom_id: str, body: dict[str, Any], context: _Context) -> ParsedRequest:
    """A chat body made from another endpoint's line (jobs.line_responses), checked as a chat line is."""
    _refuse_unsupported(body, CHAT_URL)
    return _parse_generation(number, custom_id, CHAT_URL, body, context)


def _parse_generation(number: int, custom_id: str, url: str, body: dict[str, Any], context: _Context
                      ) -> ParsedRequest:
    """A completions or chat line (a responses line, as chat): its prompt ids, token budget and sampling."""
    prompt = _prompt(body) if url == COMPLETIONS_URL else messages(body)
    requested = _requested_max_tokens(body, context.limits.max_tokens_cap)
    sampling = (line_sampling.temperature(body), line_sampling.top_p(body), line_sampling.seed(body),
                line_sampling.stop(body))
    line_sampling.check_extras(body, len(context.tokenizer))
    if url == CHAT_URL:
        check_response_format(body, context.tokenizer)
    text = _chat_text(prompt, context.tokenizer) if isinstance(prompt, list) else prompt
    _refuse_beyond_context(len(text), requested, context)
    prompt_ids = _prompt_ids(text, context.tokenizer, chat=isinstance(prompt, list))
    max_tokens = _fit_max_tokens(requested, len(prompt_ids), context.limits)
    return ParsedRequest(number, custom_id, url, body, prompt_ids, max_tokens, *sampling, n=line_sampling.choices(body),
                         top_logprobs=line_sampling.top_logprobs(body, url))


def _parse_embedding(number: int, custom_id: str, body: dict[str, Any], context: _Context) -> ParsedRequest:
    """An embeddings line: one request per input, nothing to generate."""
    inputs = line_embeddings.input_ids(body, context.tokenizer, context.limits.context_length, context.chars_per_token,
                                       context.limits.embedding.pooling)
    line_embeddings.check_options(body, context.limits.embedding)
    return ParsedRequest(number, custom_id, EMBEDDINGS_URL, body, inputs[0], 0, 0.0, 1.0, 0, [], n=len(inputs),
                         inputs=inputs)


def _one_kind(requests: list[ParsedRequest], errors: list[LineError], main: str
              ) -> tuple[list[ParsedRequest], list[LineError]]:
    """Embeddings and generations do not share a batch (a worker runs one or the other): the lines of the kind the
    batch's endpoint is not become line errors."""
    embeddings = main == EMBEDDINGS_URL
    odd = [r for r in requests if (r.url == EMBEDDINGS_URL) != embeddings]
    if not odd:
        return requests, errors
    kind = "an embeddings batch" if embeddings else "a batch of generations"
    moved = [LineError(r.line_number, r.custom_id, "invalid_url", f"url is {r.url} but this is {kind} (most lines "
                       f"are {main}); send {EMBEDDINGS_URL} lines in a batch of their own", "url") for r in odd]
    kept = [r for r in requests if (r.url == EMBEDDINGS_URL) == embeddings]
    return kept, sorted(errors + moved, key=lambda e: e.line_number)


def _url(line: dict[str, Any], endpoint: str | None) -> str:
    """The line's endpoint (the batch's, when it has one), after checking the method is POST."""
    method = line.get("method")
    if method != "POST":
        raise LineProblem("invalid_method", f'method must be "POST" (got {show(method)})', "method")
    url = line.get("url")
    if url not in URLS:
        raise LineProblem("invalid_url", f"url must be {', '.join(URLS[:-1])} or {URLS[-1]} (got {show(url)})",
                          "url")
    if endpoint is not None and url != endpoint:
        raise LineProblem("invalid_url", f"url is {url} but the batch's endpoint is {endpoint}; every line of a "
                                          f"batch uses its endpoint", "url")
    return str(url)


def _body(line: dict[str, Any], context: _Context) -> dict[str, Any]:
    """The line's body object; its `model`, when given, must be the job's model or one of its aliases."""
    body = line.get("body")
    if not isinstance(body, dict):
        raise LineProblem("invalid_body", f"body must be a JSON object, not {json_type(body)}", "body")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or model not in {context.model_name, *context.model_aliases}):
        names = " or ".join(show(name) for name in [context.model_name, *sorted(context.model_aliases)])
        raise LineProblem("model_mismatch", f"body.model is {show(model)} but this job runs {names}; "
                                             f"one batch runs one model: send these lines in a batch of their own",
                          "body.model")
    return body


# body keys honoured by endpoint (`user`, `safety_identifier` and `prompt_cache_key` name the caller's end user or
# cache, `metadata` is the caller's: kept, they change no output)
COMMON_KEYS = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "user", "n",
               "logit_bias", *EXTRAS}
BODY_KEYS = {CHAT_URL: COMMON_KEYS | {"messages", "logprobs", "top_logprobs", "response_format", "metadata",
                                      "safety_identifier", "prompt_cache_key"},
             COMPLETIONS_URL: COMMON_KEYS | {"prompt", "logprobs"},
             EMBEDDINGS_URL: line_embeddings.BODY_KEYS, RESPONSES_URL: line_responses.BODY_KEYS}
# parameters we do not honour, accepted only with the value that asks for nothing (null is accepted for any key)
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "stream": (False,), "tools": ([],), "functions": ([],), "tool_choice": ("none",),
    "function_call": ("none",), "response_format": ({"type": "text"},), "echo": (False,), "best_of": (1,),
    "suffix": ("",), "parallel_tool_calls": (False, True), "store": (False, True), "truncation": ("disabled",),
    "background": (False,), "include": ([],), "service_tier": ("auto", "default"), "modalities": (["text"],),
}
TOOL_KEYS = ("tools", "functions", "tool_choice", "function_call")  # what only tool calling would use


def _refuse_unsupported(body: dict[str, Any], url: str) -> None:
    """unsupported_parameter for the first body key this service would otherwise ignore (in the body's order)."""
    for key, value in body.items():
        if key in BODY_KEYS[url] or value is None or _is_neutral(key, value):
            continue
        if key in TOOL_KEYS:
            raise LineProblem("unsupported_parameter", f"body.{key} is given ({show(value)}): {NO_TOOLS}; remove it",
                              f"body.{key}")
        raise LineProblem("unsupported_parameter", f"body.{key} is not supported by this service (got "
                                                    f"{show(value)}); remove it, or send the value that changes "
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
        raise LineProblem("missing_prompt", f"body.prompt must be a non-empty string for {COMPLETIONS_URL} "
                                             f"(got {show(prompt)})", "body.prompt")
    return prompt


def _requested_max_tokens(body: dict[str, Any], cap: int) -> int | None:
    """max_tokens (or its alias max_completion_tokens) as asked, None when omitted."""
    name = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise invalid(name, "an integer >= 1", value)
    if value > cap:
        raise LineProblem("max_tokens_too_large", f"{name} is {value}; the limit is {cap} "
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
        raise LineProblem("context_length_exceeded",
                           f"the prompt is {chars} characters, so at least {least_prompt} tokens (a token of this "
                           f"model covers at most {context.chars_per_token} characters), and {output}, but the "
                           f"model's context is {context.limits.context_length} tokens; shorten the prompt")


def _fit_max_tokens(requested: int | None, prompt_tokens: int, limits: InputLimits) -> int:
    """The max_tokens to store: as asked, or the default lowered to fit; the total must fit the context."""
    room = limits.context_length - prompt_tokens
    max_tokens = requested if requested is not None else max(1, min(DEFAULT_MAX_TOKENS, limits.max_tokens_cap, room))
    if prompt_tokens + max_tokens > limits.context_length:
        raise LineProblem("context_length_exceeded",
                           f"the prompt is {prompt_tokens} tokens and max_tokens is {max_tokens}, "
                           f"{prompt_tokens + max_tokens} in all, but the model's context is "
                           f"{limits.context_length} tokens; shorten the prompt or lower max_tokens")
    return max_tokens


def _prompt_ids(text: str, tokenizer: Any, *, chat: bool) -> list[int]:
    """The prompt's token ids: a completion prompt as the tokenizer encodes it, a rendered chat template as it is."""
    if chat:
        return [int(i) for i in tokenizer(text, add_special_tokens=False).input_ids]
    ids = [int(i) for i in tokenizer(text).input_ids]
    if not ids:
        raise LineProblem("missing_prompt", "body.prompt encodes to no tokens")
    return ids


def _chat_text(chat: list[dict[str, str]], tokenizer: Any) -> str:
    """The messages rendered by the model's chat template, ready for the assistant's reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise LineProblem("chat_template_missing", f"this model's tokenizer has no chat template; "
                                                    f"send the prompt as text to {COMPLETIONS_URL}")
    text = _render(chat, tokenizer)
    for role in dict.fromkeys(m["role"] for m in chat if "name" in m):  # each role whose messages have names
        unnamed = [{k: v for k, v in m.items() if k != "name"} if m["role"] == role else m for m in chat]
        if _render(unnamed, tokenizer) == text:
            index = next(i for i, m in enumerate(chat) if m["role"] == role and "name" in m)
            raise LineProblem("invalid_messages", f"messages[{index}].name is {show(chat[index]['name'])}, but this "
                                                   f"model's chat template does not render the names of {role} "
                                                   f"messages; remove it, or put the name in the content",
                              f"body.messages[{index}].name")
    return text


def _render(chat: list[dict[str, str]], tokenizer: Any) -> str:
    try:
        return str(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    except Exception as exc:  # a chat template is arbitrary Jinja that may raise on messages it refuses
        raise LineProblem("invalid_messages", f"the model's chat template refused these messages: "
                                               f"{one_line(exc)}") from None


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
