"""Data: source (builtin, text, tfds) -> tokenize -> filter by length -> pack into token-budget batches.

Training batches pack several sentence pairs into each row of `max_length` tokens (with segment ids and
per-segment positions, so attention never crosses sentences), `tokens_per_batch // max_length` rows per
batch: one fixed shape, hence one compilation, and almost no padding. Batch k of a run is a pure
function of (seed, k): epoch e shuffles with seed (seed, e), so a resumed run sees exactly the batches an
uninterrupted one would have seen.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import numpy as np

from transformer import corpus, sources
from transformer.sources import DataError
from transformer.tokenizer import Tokenizer, train_tokenizer

SOURCES = ("builtin", "text", "tfds")
SPLITS = ("train", "valid", "test")
Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Built from `config.data`; see configs/default.py for each field's meaning."""

    source: str = "builtin"
    source_lang: str = "en"
    target_lang: str = "es"
    builtin_seed: int = 0
    builtin_train_size: int = 100_000
    builtin_valid_size: int = 1_000
    builtin_test_size: int = 1_000
    text_dir: str = ""
    tfds_name: str = ""
    tfds_data_dir: str = ""
    train_split: str = "train"
    valid_split: str = "valid"
    test_split: str = "test"
    vocab_path: str = ""
    vocab_size: int = 8000
    vocab_character_coverage: float = 1.0
    vocab_max_sentences: int = 1_000_000
    max_length: int = 64
    tokens_per_batch: int = 4096

    def __post_init__(self):
        if self.source not in SOURCES:
            raise DataError(f"data.source={self.source!r} is not one of {SOURCES}")
        if self.source == "text" and not self.text_dir:
            raise DataError("data.source='text' needs data.text_dir (e.g. --config.data.text_dir=path/to/corpus)")
        if self.source == "tfds" and not self.tfds_name:
            raise DataError("data.source='tfds' needs data.tfds_name (e.g. wmt14_translate/de-en)")
        if self.max_length < 2:
            raise DataError(f"data.max_length={self.max_length} is too small")
        if self.tokens_per_batch < self.max_length:
            raise DataError(f"data.tokens_per_batch={self.tokens_per_batch} is smaller than one row of "
                            f"data.max_length={self.max_length} tokens")

    @property
    def rows_per_batch(self) -> int:
        return self.tokens_per_batch // self.max_length

    def split_name(self, split: str) -> str:
        return {"train": self.train_split, "valid": self.valid_split, "test": self.test_split}[split]


def text_files(config: DataConfig, split: str) -> tuple[str, str]:
    """`{text_dir}/{split_name}.{lang}`, or the same with `.gz` when only that exists."""
    paths = []
    for lang in (config.source_lang, config.target_lang):
        path = os.path.join(config.text_dir, f"{config.split_name(split)}.{lang}")
        paths.append(path + ".gz" if not os.path.exists(path) and os.path.exists(path + ".gz") else path)
    return paths[0], paths[1]


def read_split(config: DataConfig, split: str) -> list[tuple[str, str]]:
    """(source, target) sentence pairs of one split."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {SPLITS}")
    if config.source == "builtin":
        sizes = dict(train_size=config.builtin_train_size, valid_size=config.builtin_valid_size,
                     test_size=config.builtin_test_size)
        return corpus.builtin_split(split, seed=config.builtin_seed, source_lang=config.source_lang,
                                    target_lang=config.target_lang, **sizes)
    if config.source == "text":
        return sources.read_text_pair(*text_files(config, split))
    return sources.read_tfds(config.tfds_name, config.split_name(split), source_lang=config.source_lang,
                             target_lang=config.target_lang, data_dir=config.tfds_data_dir or None)


def load_or_train_tokenizer(config: DataConfig, train_pairs: list[tuple[str, str]], workdir: str) -> Tokenizer:
    """The given vocab_path, else `workdir/vocab.model` if a previous run wrote it, else train one there."""
    if config.vocab_path:
        if not os.path.exists(config.vocab_path):
            raise DataError(f"data.vocab_path={config.vocab_path} does not exist")
        return Tokenizer(config.vocab_path)
    path = os.path.join(workdir, "vocab.model")
    if os.path.exists(path):  # written by an earlier start of this run: resume with the same ids
        tokenizer = Tokenizer(path)
        if tokenizer.vocab_size != config.vocab_size:
            raise DataError(f"{path} has {tokenizer.vocab_size} pieces but data.vocab_size={config.vocab_size}: "
                            "this workdir belongs to another run; use a new --workdir")
        return tokenizer
    sentences = [text for pair in train_pairs for text in pair]
    return train_tokenizer(sentences, path, vocab_size=config.vocab_size,
                           character_coverage=config.vocab_character_coverage,
                           max_sentences=config.vocab_max_sentences)


@dataclasses.dataclass
class Examples:
    """Tokenized pairs of one split (each ending in EOS)."""

    inputs: list[np.ndarray]
    targets: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.inputs)


def tokenize(tokenizer: Tokenizer, pairs: list[tuple[str, str]]) -> Examples:
    return Examples(tokenizer.encode([s for s, _ in pairs]), tokenizer.encode([t for _, t in pairs]))


def filter_by_length(examples: Examples, max_length: int) -> tuple[Examples, int]:
    """Keep pairs whose both sides fit in max_length tokens; returns (kept, number dropped)."""
    keep = [i for i in range(len(examples))
            if len(examples.inputs[i]) <= max_length and len(examples.targets[i]) <= max_length]
    kept = Examples([examples.inputs[i] for i in keep], [examples.targets[i] for i in keep])
    return kept, len(examples) - len(kept)


def pack_rows(examples: Examples, order: np.ndarray, max_length: int) -> list[list[int]]:
    """Next-fit packing: walk `order`, opening a new row when a pair's source or target would overflow."""
    rows, row, source_used, target_used = [], [], 0, 0
    for index in order:
        source_length, target_length = len(examples.inputs[index]), len(examples.targets[index])
        if row and (source_used + source_length > max_length or target_used + target_length > max_length):
            rows.append(row)
            row, source_used, target_used = [], 0, 0
        row.append(int(index))
        source_used += source_length
        target_used += target_length
    if row:
        rows.append(row)
    return rows


def make_batch(examples: Examples, rows: list[list[int]], num_rows: int, max_length: int) -> Batch:
    """Packed arrays [num_rows, max_length]; rows beyond len(rows) stay empty (all padding)."""
    batch = {key: np.zeros((num_rows, max_length), np.int32) for key in (
        "inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position", "targets_position")}
    for row_index, row in enumerate(rows):
        for side, sequences in (("inputs", examples.inputs), ("targets", examples.targets)):
            start = 0
            for segment, example in enumerate(row, start=1):
                tokens = sequences[example]
                end = start + len(tokens)
                batch[side][row_index, start:end] = tokens
                batch[f"{side}_segmentation"][row_index, start:end] = segment
                batch[f"{side}_position"][row_index, start:end] = np.arange(len(tokens))
                start = end
    return batch


class TrainBatches:
    """Endless packed training batches; `iterate(start_step)` resumes exactly at batch `start_step`."""

    def __init__(self, examples: Examples, *, max_length: int, rows_per_batch: int, seed: int):
        if len(examples) == 0:
            raise DataError("no training pairs left after length filtering; raise data.max_length")
        self.examples, self.max_length, self.rows_per_batch, self.seed = examples, max_length, rows_per_batch, seed

    def epoch_batches(self, epoch: int) -> list[list[list[int]]]:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
        rows = pack_rows(self.examples, order, self.max_length)
        # Drop the last partial batch of an epoch: every step sees a full token budget.
        num_batches = max(len(rows) // self.rows_per_batch, 1)
        return [rows[i * self.rows_per_batch:(i + 1) * self.rows_per_batch] for i in range(num_batches)]

    def iterate(self, start_step: int = 0) -> Iterator[Batch]:
        epoch, skip = 0, start_step
        while True:
            batches = self.epoch_batches(epoch)
            for rows in batches[skip:]:
                yield make_batch(self.examples, rows, self.rows_per_batch, self.max_length)
            skip = max(skip - len(batches), 0)
            epoch += 1


def eval_batches(examples: Examples, *, max_length: int, rows_per_batch: int) -> list[Batch]:
    """Packed batches of a whole split in order; the last is padded with empty rows to the same shape."""
    rows = pack_rows(examples, np.arange(len(examples)), max_length)
    return [make_batch(examples, rows[i:i + rows_per_batch], rows_per_batch, max_length)
            for i in range(0, len(rows), rows_per_batch)]


def bucket_length(length: int, minimum: int = 8) -> int:
    """The next power of two >= length: few distinct shapes, so few decoder compilations."""
    return max(minimum, 1 << (max(length, 1) - 1).bit_length())


def decode_batches(inputs: list[np.ndarray], batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(indices, padded inputs [batch_size, bucket_length]) sorted by length; the last batch's extra rows
    repeat index -1 and are all padding."""
    order = np.argsort([len(x) for x in inputs], kind="stable")
    for start in range(0, len(order), batch_size):
        indices = order[start:start + batch_size]
        length = bucket_length(max(len(inputs[i]) for i in indices))
        batch = np.zeros((batch_size, length), np.int32)
        for row, index in enumerate(indices):
            batch[row, :len(inputs[index])] = inputs[index]
        yield np.pad(indices, (0, batch_size - len(indices)), constant_values=-1), batch
