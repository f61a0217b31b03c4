"""Write a tiny random decoder-only model with a real ChatML tokenizer, for fast tests."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from modelprep.errors import ModelPrepError
from swarmnet.families import FAMILIES, unsupported_family

logger = logging.getLogger(__name__)

TINY_ARCHS = tuple(FAMILIES)  # every supported family, by its Hugging Face model_type
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
BOS_ID, EOS_ID = 1, 2
TARGET_VOCAB = 1000
NUM_HEADS, NUM_KV_HEADS = 4, 2
MAX_POSITIONS = 2048
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = """\
The city council voted on Tuesday to expand the downtown bike lane network by twelve miles over the next two years.
Supporters argued that the project will reduce traffic congestion and improve safety for cyclists and pedestrians.
Opponents worried about the loss of street parking and the impact on small businesses during construction.

Scientists reported that the price of solar panels fell again last year, making clean energy cheaper than coal in
many countries. Engineers are now building larger batteries so that power from the sun can be stored for the night.
Some experts say the grid must change quickly; others think the market will solve the problem on its own.

The summer was hot and dry, and the river that runs through the valley dropped to its lowest level in forty years.
Farmers asked the government for help, while families spent their weekends by the lake, reading books and swimming.
In the autumn the rain came back, the leaves turned red and gold, and the children went back to school.

Write a short summary of the following text. Answer the question in one sentence. Translate this paragraph into
simple English. What is the main idea? Who said what, when, and why? Please explain your answer step by step.
You are a helpful assistant. The user asks a question and the assistant gives a clear, friendly and honest reply.

A small team of volunteers opened a library in an old train station. They collected thousands of books, painted the
walls, and built shelves from wood they found in a closed factory. Every Saturday, a teacher reads stories aloud,
and people of all ages come to listen, to borrow books, to drink coffee and to talk with their neighbours.

Markets rose on Monday after the central bank said it would keep interest rates unchanged for another quarter.
Companies that make computers, phones and software gained the most, while oil and gas prices were mostly flat.
Analysts expect growth to slow next year, but unemployment remains low and consumers continue to spend money.
Numbers like 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 2024 and 3.14 appear in text;
so do symbols: ( ) [ ] { } ! ? - : ; " ' / and @.
"""


def write_tiny_model(out: Path, *, layers: int = 4, arch: str = "llama", hidden_size: int = 64, seed: int = 0,
                     context: int = MAX_POSITIONS, shard_size: str | None = None, manifest: bool = False) -> Path:
    """Write a random ``arch`` model (float32, safetensors) plus a ChatML BPE tokenizer into ``out``; return it.

    ``context`` is its max_position_embeddings (a short one makes long-document tests cheap). ``shard_size`` (e.g.
    "100KB") cuts the weights into shards of at most that size, with a model.safetensors.index.json; ``manifest``
    writes swarmbatch-manifest.json (swarmnet/manifest.py), so a copy may keep only some shards.
    """
    _check_args(layers, arch, hidden_size)
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = _build_model(arch, layers, hidden_size, len(tokenizer), seed, context)
    model.save_pretrained(str(out), **({"max_shard_size": shard_size} if shard_size else {}))
    tokenizer.save_pretrained(str(out))
    if manifest:
        from swarmnet.manifest import write_manifest

        write_manifest(out)
    _make_readable(out)
    logger.info("wrote tiny %s model (%d layers, vocab %d) to %s", arch, layers, len(tokenizer), out)
    return out


def _check_args(layers: int, arch: str, hidden_size: int) -> None:
    """Reject arguments that cannot make a valid tiny model."""
    if arch not in TINY_ARCHS:
        raise ModelPrepError(unsupported_family(arch))
    if layers < 1:
        raise ModelPrepError(f"layers must be >= 1 (got {layers}); pass a positive layer count")
    if hidden_size < 2 * NUM_HEADS or hidden_size % (2 * NUM_HEADS):
        raise ModelPrepError(
            f"hidden_size must be a positive multiple of {2 * NUM_HEADS} (got {hidden_size}); pick e.g. 64"
        )


def _make_readable(out: Path) -> None:
    """Give the written files mode 0644 (save_pretrained writes model.safetensors as 0600)."""
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o644)


def build_tokenizer() -> Any:
    """Train a deterministic byte-level BPE on the built-in corpus and wrap it as a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(),
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        pad_token=SPECIAL_TOKENS[EOS_ID],
        unk_token=None,
        padding_side="left",
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _train_bpe() -> Any:
    """Train a byte-level BPE (special tokens first, so they get ids 0, 1, 2) on ``CORPUS``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return bpe


def _build_model(arch: str, layers: int, hidden_size: int, vocab_size: int, seed: int, context: int) -> Any:
    """Build a randomly initialised float32 causal LM of ``arch`` with seeded, reproducible weights."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _make_config(arch, layers, hidden_size, vocab_size, context)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    return model.eval()


def _make_config(arch: str, layers: int, hidden_size: int, vocab_size: int, context: int) -> Any:
    """Return the transformers config for a tiny ``arch`` model (4 heads, 2 KV heads, MLP 2x hidden).

    The family's own `tiny` options (swarmnet/families.py) come on top: e.g. Gemma's head_dim and sliding layers.
    """
    from transformers import AutoConfig

    extra = dict(FAMILIES[arch].tiny)
    if "layer_types" in extra:  # a pattern, repeated over the layers
        extra["layer_types"] = [extra["layer_types"][i % len(extra["layer_types"])] for i in range(layers)]
    return AutoConfig.for_model(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=context,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        **{"pad_token_id": EOS_ID, **extra},
    )
