"""Constrained decoding: a grammar masks one sequence's logits, after the penalties and before sampling (llguidance).

A `Grammar` is llguidance's grammar text bound to the tokenizer it is matched against. Each constrained row of a
batch gets its own `Constraint` (a matcher): at every step it allows only the tokens that keep the output a prefix
of some string of the grammar, and EOS only where the grammar accepts the output as complete (once the grammar
allows nothing more, EOS alone). The matcher's state is a function of the tokens it consumed, so a request resumed
from its committed token ids feeds them to a fresh matcher and goes on exactly as the interrupted run would have.

Why llguidance (bench/RESULTS.md, "Constrained decoding"): on SmolLM2's 49,152-token vocabulary it builds a schema's
matcher in under a millisecond (no ahead-of-time index: outlines-core took 0.3 s for a small schema and 7.6 s for
"any JSON object"), computes a mask in tens of microseconds (as xgrammar does), reports what a schema uses that it
cannot enforce by name, and ships as one dependency-free abi3 wheel for every Python we support (xgrammar pulls
triton and a TVM runtime in).
"""
from __future__ import annotations

import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf
import torch

# JSON the model cannot pad: no whitespace between tokens (a model cannot spend its max_tokens on blank lines)
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class ConstraintError(RuntimeError):
    """A constrained sequence met a token its grammar refuses (a bug, or a grammar the library changed under it)."""


@dataclass(frozen=True)
class Grammar:
    """An llguidance grammar (`json_grammar`) and the tokenizer (`grammar_tokenizer`) its masks are computed for."""

    text: str
    tokenizer: llguidance.LLTokenizer = field(compare=False, repr=False)


def json_grammar(schema: dict[str, Any] | None, *, lenient: bool = False) -> str:
    """The grammar of compact JSON that validates against `schema` (None: any JSON object).

    lenient: keywords the library cannot enforce are ignored (else the grammar fails to compile, naming them).
    Raises ValueError when `schema` is not a JSON object.
    """
    options: Any = {**COMPACT_JSON, "lenient": lenient}
    return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"} if schema is None else schema,
                                                             overrides=options))


def grammar_error(text: str, tokenizer: llguidance.LLTokenizer | None = None) -> str | None:
    """Why the grammar does not compile (for that tokenizer, when given), or None when it does."""
    return llguidance.LLMatcher.validate_grammar(text, tokenizer) or None


_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple[tuple[int, ...], int | None], llguidance.LLTokenizer]] = \
    weakref.WeakKeyDictionary()


def grammar_tokenizer(hf_tokenizer: Any, *, eos_token_ids: Collection[int] = (),
                      vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of a (fast) Hugging Face tokenizer, cached per tokenizer (building it takes ~0.4 s for a
    49k vocabulary). eos_token_ids: the tokens that end a sequence (default the tokenizer's EOS); vocab_size: the
    logits' width when the model has more rows than the tokenizer has tokens."""
    key = (tuple(sorted(eos_token_ids)), vocab_size)
    cached = _TOKENIZERS.setdefault(hf_tokenizer, {})
    if key not in cached:
        eos = list(key[0]) or None
        cached[key] = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
    return cached[key]


class Constraint:
    """One sequence's matcher: which tokens may come next, given the output so far (`earlier`: its tokens from
    before a resume)."""

    def __init__(self, grammar: Grammar, earlier: Sequence[int] = ()) -> None:
        self.matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.text, log_level=0)
        self.bitmask = torch.zeros((grammar.tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
        for token in earlier:
            self.add(token)

    def allowed(self, vocab: int) -> torch.Tensor:
        """A bool mask [vocab] of the tokens the grammar allows next (a token the tokenizer lacks never is)."""
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.bitmask.numel() * 4)
        self._check()
        bits = (self.bitmask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = torch.zeros(vocab, dtype=torch.bool)
        width = min(vocab, bits.numel())
        allowed[:width] = bits.flatten()[:width].bool()
        return allowed

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits [V] with every token the grammar refuses at -inf (a new tensor)."""
        return torch.where(self.allowed(logits.shape[-1]), logits, float("-inf"))

    def add(self, token: int) -> None:
        """Advance past a token of the output."""
        self.matcher.consume_token(token)
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ConstraintError(f"the output's grammar failed: {self.matcher.get_error().splitlines()[0]}")
