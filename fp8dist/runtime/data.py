"""Batches for launch/train.py, the audit and `fp8dist compare`: synthetic token batches, or a user's local
text / JSONL file tokenised by the model directory's tokenizer (bytes where it has none)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from fp8dist.errors import Fp8distError

SYNTHETIC_BATCHES = 4  # a fixed pool of batches per rank, cycled, so that the loss visibly goes down
MAX_DATA_BYTES = 256 << 20


class BatchMaker(Protocol):
    """make_batch(batch, seq_len, seed) -> a micro-batch's forward kwargs, labels included; the same for the same
    arguments."""

    def __call__(self, batch: int, seq_len: int, seed: int) -> dict[str, Any]: ...


def batches_for(make_batch: BatchMaker, spec, step: int, rank: int,
                pool: int | None = SYNTHETIC_BATCHES) -> list[dict]:
    """The micro-batches of optimizer step `step` on `rank`: the same on every run of the same config.
    `pool`: cycle that many batches per rank (synthetic data), or None for a new batch every micro-step."""
    t = spec.train
    first = step * t.gradient_accumulation_steps
    index = [(first + i) % pool if pool else first + i for i in range(t.gradient_accumulation_steps)]
    return [make_batch(t.micro_batch_size, t.seq_len, seed=t.seed * 100_003 + rank * 1009 + i) for i in index]


def read_texts(path: Path) -> list[str]:
    if not path.is_file():
        raise Fp8distError(f"--data {path}: no such file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise Fp8distError(f"--data {path}: cannot read it ({exc.strerror})") from None
    if len(raw) > MAX_DATA_BYTES:
        raise Fp8distError(f"--data {path}: {len(raw)} bytes, more than the {MAX_DATA_BYTES}-byte limit of a "
                           "comparison sample; cut a sample of it")
    if b"\x00" in raw:
        raise Fp8distError(f"--data {path}: binary file (contains NUL bytes); pass UTF-8 text or JSONL")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Fp8distError(f"--data {path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        raise Fp8distError(f"--data {path}: empty file; it needs some text to tokenise")
    if path.suffix == ".jsonl":
        out = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise Fp8distError(f"--data {path}: line {number} is not JSON ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise Fp8distError(f"--data {path}: line {number} needs a string `text` field")
            out.append(record["text"])
        return out
    return [text]


def token_stream(path: str, model_dir: str | None, vocab_size: int) -> tuple[list[int], str]:
    """All tokens of the file, and how they were made."""
    texts = read_texts(Path(path))
    tokenizer = None
    if model_dir and Path(model_dir).is_dir() and any((Path(model_dir) / name).exists() for name in
                                                         ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise Fp8distError(f"cannot load the tokenizer in {model_dir}: {str(exc).splitlines()[0]}") from None
    if tokenizer is not None:
        ids = [i for text in texts for i in tokenizer(text)["input_ids"]]
        if ids and max(ids) >= vocab_size:
            raise Fp8distError(f"the tokenizer in {model_dir} gives token ids up to {max(ids)}, beyond the model's "
                               f"vocab_size {vocab_size}; the tokenizer does not belong to this model")
        how = f"tokenised by {type(tokenizer).__name__} from {model_dir}"
    else:
        ids = [b % vocab_size for text in texts for b in text.encode("utf-8")]
        how = "bytes (the model has no tokenizer here)"
    return ids, how


def file_batches(ids: list[int]) -> BatchMaker:
    """make_batch(batch, seq_len, seed) over a token stream: deterministic windows chosen by `seed`."""
    def make(batch: int, seq_len: int, seed: int) -> dict:
        import torch

        if len(ids) < seq_len + 1:
            raise Fp8distError(f"--data has {len(ids)} tokens, fewer than one sequence of train.seq_len={seq_len}; "
                               "give more text or lower train.seq_len")
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(ids) - seq_len, (batch,), generator=gen).tolist()
        tokens = torch.tensor([ids[s:s + seq_len] for s in starts])
        return {"input_ids": tokens, "labels": tokens.clone()}

    return make
