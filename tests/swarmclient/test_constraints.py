"""Constrained decoding: each row of a batch follows its own grammar (or none), EOS only where the grammar accepts,
a bias cannot push a refused token, and a matcher rebuilt from earlier tokens continues as the uninterrupted run.

The model is the tiny random one, run in this process (its blocks as one local span), so its tokens are noise:
whatever the output says, its shape comes from the grammar alone. Schemas are checked by `jsonschema`, not by the
library that constrained the decoding.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from generation_checks import CITY

from servers.block_loading import load_span
from swarmclient.constraints import Constraint, Grammar, grammar_tokenizer, json_grammar
from swarmclient.generation import generate_tokens
from swarmclient.penalties import Penalties
from swarmclient.sampling import SamplingParams
from swarmclient.textgen import load_tokenizer
from swarmnet.head import ClientHead
from swarmnet.model_spec import ModelSpec

TAGS = {"type": "object", "additionalProperties": False, "required": ["tags", "score"],
        "properties": {"tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 6}},
                       "score": {"type": "number", "minimum": -1, "maximum": 1}}}
PROMPTS = ["Describe a city", "List some tags", "Any JSON object", "Hello world, this is"]
NEW_TOKENS = 80


class Local:
    """The tiny model in this process: a local span of all its blocks behind the client's head."""

    def __init__(self, model_dir: Path) -> None:
        self.spec, self.tokenizer = ModelSpec.open(model_dir), load_tokenizer(model_dir)
        self.span, self.head = load_span(self.spec, 0, self.spec.num_blocks), ClientHead(self.spec)
        self.eos = self.spec.eos_token_ids

    def grammar(self, schema: dict[str, Any] | None) -> Grammar:
        return Grammar(json_grammar(schema), grammar_tokenizer(self.tokenizer, eos_token_ids=self.eos,
                                                               vocab_size=self.spec.config.vocab_size))

    def token(self, text: str) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(text))

    def generate(self, inputs: list[list[int]], params: list[SamplingParams], new_tokens: int) -> list[list[int]]:
        """Each row's new tokens up to and with its EOS (inputs are token ids, left padded here)."""
        width = max(len(ids) for ids in inputs)
        ids = torch.tensor([[0] * (width - len(row)) + row for row in inputs])
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in inputs])
        cache = self.span.new_caches(0, self.spec.num_blocks)
        out = generate_tokens(self.head, lambda h, m, p: self.span(h, m, p, cache), ids, mask,
                              max_new_tokens=new_tokens, params=params, eos_token_ids=self.eos, pad_token_id=0)
        return [until_eos(row.tolist(), self.eos) for row in out]

    def text(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False).input_ids]


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    ends = [i for i, token in enumerate(tokens) if token in eos]
    return tokens[:ends[0] + 1] if ends else tokens


@pytest.fixture(scope="module")
def local(tiny_model: Path) -> Local:
    return Local(tiny_model)


def object_biases(local: Local) -> Penalties:
    """Biases that make the random model close strings and objects soon (it would babble keys forever)."""
    return Penalties(logit_bias=((local.token('"'), 5.0), (local.token("}"), 2.0)))


def test_each_row_of_a_batch_follows_its_own_schema_and_an_unconstrained_row_is_untouched(local: Local) -> None:
    # Given a batch of four rows: two schemas (greedy, sampled), any JSON object (sampled), and free text (greedy)
    params = [SamplingParams(grammar=local.grammar(CITY)),
              SamplingParams(temperature=1.0, seed=7, grammar=local.grammar(TAGS)),
              SamplingParams(temperature=0.8, seed=3, grammar=local.grammar(None), penalties=object_biases(local)),
              SamplingParams()]
    inputs = [local.encode(prompt) for prompt in PROMPTS]
    # When they are decoded together
    rows = local.generate(inputs, params, NEW_TOKENS)
    # Then each constrained row ended with EOS, and its text is compact JSON that its schema validates
    for tokens, schema in zip(rows[:3], (CITY, TAGS, {"type": "object"}), strict=True):
        assert tokens[-1] in local.eos, local.text(tokens)
        value = json.loads(local.text(tokens))
        jsonschema.validate(value, schema)
        assert local.text(tokens) == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    assert json.loads(local.text(rows[2]))  # the biases leave the object a key at least
    # and the free-text row is what it is alone, unconstrained (a row's mask never touches its neighbours)
    assert rows[3] == local.generate(inputs[3:], [SamplingParams()], NEW_TOKENS)[0]
    assert rows[3] != rows[0]


def test_eos_is_allowed_only_once_the_grammar_accepts_the_output(local: Local) -> None:
    constraint = Constraint(local.grammar({"type": "object", "properties": {"a": {"type": "integer"}},
                                           "required": ["a"], "additionalProperties": False}))
    [eos] = local.eos
    vocab = local.spec.config.vocab_size
    assert constraint.allowed(vocab).nonzero().flatten().tolist() == [local.token("{")]  # '{"' and '{}' are refused
    for token in local.encode('{"a":12'):
        assert not constraint.allowed(vocab)[eos]
        constraint.add(token)
    constraint.add(local.token("}"))
    assert constraint.allowed(vocab).nonzero().flatten().tolist() == [eos]  # complete: nothing but EOS


def test_a_bias_toward_a_token_the_grammar_refuses_cannot_choose_it(local: Local) -> None:
    # logit_bias runs first (+100 on "}": alone, it writes nothing else), then the mask: the schema's keys still come
    bias = Penalties(logit_bias=((local.token("}"), 100.0),))
    [unmasked] = local.generate([local.encode(PROMPTS[0])], [SamplingParams(penalties=bias)], 4)
    assert unmasked == [local.token("}")] * 4
    for params in (SamplingParams(penalties=bias, grammar=local.grammar(CITY)),
                   SamplingParams(temperature=1.0, seed=1, penalties=bias, grammar=local.grammar(CITY))):
        [tokens] = local.generate([local.encode(PROMPTS[0])], [params], NEW_TOKENS)
        jsonschema.validate(json.loads(local.text(tokens)), CITY)


@pytest.mark.parametrize("earlier", [1, 9, 20])
def test_a_matcher_rebuilt_from_the_earlier_tokens_continues_as_the_uninterrupted_run(local: Local,
                                                                                      earlier: int) -> None:
    # Given a sampled, constrained row decoded in one go
    params = SamplingParams(temperature=1.0, seed=11, grammar=local.grammar(TAGS))
    prompt = local.encode(PROMPTS[1])
    [whole] = local.generate([prompt], [params], NEW_TOKENS)
    assert len(whole) > earlier
    # When it is resumed after `earlier` tokens: they come back as input, and the matcher consumes them first
    resumed = SamplingParams(temperature=1.0, seed=11, grammar=local.grammar(TAGS), earlier_tokens=earlier)
    [rest] = local.generate([prompt + whole[:earlier]], [resumed], NEW_TOKENS - earlier)
    # Then it goes on with the tokens the uninterrupted run chose
    assert whole[:earlier] + rest == whole
