"""Data: source (builtin, text, tfds) -> tokenize -> filter by length -> pack -> token-budget batches.

Training runs through a grain pipeline over a token cache:

    stream the split once into a spill on disk -> vocabulary from a seeded sample of it -> tokenize once
    (grain, optional worker processes) into `workdir/tokens/` (npy files, written chunk by chunk) -> drop pairs longer than max_length (counted and logged) -> global shuffle, reseeded every epoch
    -> repeat -> this process's shard (every process_count-th element, so shards are disjoint and together
    complete) -> first-fit packing into rows of max_length (segment ids + positions, so attention never
    crosses sentences) -> rows_per_batch rows per batch -> optional grain worker processes.

The cache is named by a fingerprint of what it came from (the source's identity, not its contents: see
`split_fingerprint`) and by the vocabulary, so a restart finds it without reading the training split at all.
One batch shape, hence one compilation, and little padding. The grain iterator's state goes into each
checkpoint, so a resumed run continues exactly where the saved one stopped. Evaluation and decoding use
batches of whole splits: `eval_batches` packs them as training does, decode.py buckets them by length.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grain
import jax
import numpy as np

from transformer import config_files, corpus, files, sources
from transformer.console import log
from transformer.errors import DataError
from transformer.token_cache import (CACHE_FILES, SOURCE_FILE, PairSpill, TokenCache, cache_directory, cache_record,
                                     check_cache_record, fetch_cache, in_worker_processes)
from transformer.tokenizer import SYNTHETIC_TAG, VOCAB_MODEL_TYPES, Tokenizer, train_tokenizer
from transformer.workdir import VOCABULARY_FILE, VocabularyMismatchError, fingerprint

SOURCES = ("builtin", "text", "tfds")
SPLITS = ("train", "valid", "test")
Batch = dict[str, np.ndarray]


@config_files.section("data")
class DataConfig:
    """Built from `config.data`; transformer/defaults.py holds each field's default and meaning."""

    source: str
    source_lang: str
    target_lang: str
    builtin_seed: int
    builtin_train_size: int
    builtin_valid_size: int
    builtin_test_size: int
    text_dir: str
    tfds_name: str
    tfds_data_dir: str
    train_split: str
    valid_split: str
    test_split: str
    vocab_path: str
    vocab_size: int
    vocab_model_type: str
    vocab_character_coverage: float
    vocab_max_sentences: int
    vocab_max_characters: int
    max_length: int
    tokens_per_batch: int
    pack: bool
    num_workers: int
    local_cache_dir: str
    mixture: str
    tag_synthetic: bool
    filter_max_ratio: float
    filter_duplicates: bool
    filter_copies: bool
    filter_max_characters: int
    filter_language: bool

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
        if self.num_workers < 0:
            raise DataError(f"data.num_workers={self.num_workers} must be >= 0")
        if self.vocab_model_type not in VOCAB_MODEL_TYPES:
            raise DataError(f"data.vocab_model_type={self.vocab_model_type!r} is not one of {VOCAB_MODEL_TYPES}")
        if self.filter_max_ratio and self.filter_max_ratio < 1 or self.filter_max_characters < 0:
            raise DataError(f"data.filter_max_ratio={self.filter_max_ratio} must be 0 (off) or >= 1 and "
                            f"data.filter_max_characters={self.filter_max_characters} >= 0 (0: off)")
        if self.vocab_max_sentences <= 0 or self.vocab_max_characters < 0:
            raise DataError(f"data.vocab_max_sentences={self.vocab_max_sentences} must be > 0 and "
                            f"data.vocab_max_characters={self.vocab_max_characters} >= 0")

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
        paths.append(path + ".gz" if not files.exists(path) and files.exists(path + ".gz") else path)
    return paths[0], paths[1]


def read_split(config: DataConfig, split: str) -> list[tuple[str, str]]:
    """(source, target) sentence pairs of one split."""
    return list(iter_split(config, split))


def iter_split(config: DataConfig, split: str) -> Iterator[tuple[str, str]]:
    """The pairs of `read_split`, streamed."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {SPLITS}")
    if config.source == "builtin":
        sizes = dict(train_size=config.builtin_train_size, valid_size=config.builtin_valid_size,
                     test_size=config.builtin_test_size)
        return corpus.iter_builtin_split(split, seed=config.builtin_seed, source_lang=config.source_lang,
                                         target_lang=config.target_lang, **sizes)
    if config.source == "text":
        return sources.iter_text_pair(*text_files(config, split))
    return sources.iter_tfds(config.tfds_name, config.split_name(split), source_lang=config.source_lang,
                             target_lang=config.target_lang, data_dir=config.tfds_data_dir or None)


def split_fingerprint(config: DataConfig, split: str) -> dict[str, Any]:
    """What a split is read from, found without reading a pair of it: the built-in generator's version, seed
    and size; each text file's path, size and modification time; the TFDS dataset's name, version, where it
    is prepared, split and example count. Stat, not a content digest, for text files: a digest would read
    all of WMT14's text (over a gigabyte) on every restart, while any edit changes the modification time (a
    copy or `touch` only costs a rebuild)."""
    common = {"source": config.source, "split": split, "languages": [config.source_lang, config.target_lang]}
    if config.source == "builtin":
        size = {"train": config.builtin_train_size, "valid": config.builtin_valid_size,
                "test": config.builtin_test_size}[split]
        return {**common, "generator": corpus.GENERATOR_VERSION, "seed": config.builtin_seed, "size": size}
    if config.source == "text":
        return {**common, "files": [sources.file_fingerprint(path) for path in text_files(config, split)]}
    return {**common, "tfds": sources.tfds_fingerprint(config.tfds_name, config.split_name(split),
                                                        config.tfds_data_dir or None)}


class SplitSource:
    """A split known by its fingerprint, whose pairs are read only if the vocabulary or the token cache must
    be built: then once, streamed into a spill in the workdir that both read, removed by `close`."""

    def __init__(self, name: str, fingerprint: dict[str, Any], pairs: Iterable[tuple[str, str]]):
        self.name, self.fingerprint, self._pairs = name, fingerprint, pairs
        self._spill: PairSpill | None = None

    @classmethod
    def of_pairs(cls, pairs: list[tuple[str, str]], name: str = "pairs") -> "SplitSource":
        """Pairs already in memory, fingerprinted by their content."""
        digest = hashlib.sha256()
        for pair in pairs:
            digest.update(repr(pair).encode())
        return cls(name, {"source": "pairs", "pairs": len(pairs), "sha256": digest.hexdigest()}, pairs)

    def spill(self, directory: str) -> PairSpill | list[tuple[str, str]]:
        """The pairs with random access: an in-memory list as it is, a stream spilled (once) under directory."""
        if isinstance(self._pairs, list):
            return self._pairs
        if self._spill is None:
            start = time.perf_counter()
            self._spill = PairSpill.write(self._pairs, os.path.join(directory, f"{self.name}-text.tmp{os.getpid()}"))
            if not len(self._spill):
                raise DataError(f"the {self.name} split has no sentence pairs")
            log.info("read %d %s pairs into %s in %.1fs", len(self._spill), self.name, self._spill.directory,
                         time.perf_counter() - start)
        return self._spill

    def sentences(self, directory: str) -> Sequence[str]:
        spill = self.spill(directory)
        return spill.sentences() if isinstance(spill, PairSpill) else [text for pair in spill for text in pair]

    def close(self) -> None:
        if self._spill is not None:
            parent = os.path.dirname(self._spill.directory)
            self._spill.remove()
            self._spill = None
            if os.path.isdir(parent) and not os.listdir(parent):  # a start that failed leaves no empty tokens/
                os.rmdir(parent)

    def __enter__(self) -> "SplitSource":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def split_source(config: DataConfig, split: str) -> SplitSource:
    """The split's fingerprint now (a missing file or dataset fails here), its pairs only when spilled."""
    return SplitSource(split, split_fingerprint(config, split), iter_split(config, split))


def as_split_source(pairs: SplitSource | list[tuple[str, str]], name: str) -> SplitSource:
    return pairs if isinstance(pairs, SplitSource) else SplitSource.of_pairs(pairs, name)


class SplitPairs(dict):
    """split -> its (source, target) pairs, each split read on first use: the trainer reads the evaluation
    splits at start, and the train split only if something asks for its text (BLEU on train)."""

    def __init__(self, config: DataConfig):
        super().__init__()
        self.config = config

    def __missing__(self, split: str) -> list[tuple[str, str]]:
        self[split] = pairs = read_split(self.config, split)
        return pairs


def wait_for_file(path: str, what: str, timeout_seconds: float = 3600.0, poll_seconds: float = 1.0,
                  hint: str = "") -> None:
    """Block until process 0 has written `path` (files are written under a temporary name and renamed,
    so existence means complete)."""
    deadline = time.monotonic() + timeout_seconds
    while not files.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_seconds:.0f}s for process 0 to write the {what} {path}; "
                               f"did process 0 fail? Its log says why.{hint}")
        time.sleep(poll_seconds)


def load_or_train_tokenizer(config: DataConfig, train: SplitSource | list[tuple[str, str]], workdir: str, *,
                            process_index: int | None = None) -> Tokenizer:
    """`workdir/vocab.model`: copied there from data.vocab_path on first use (so the workdir is self-contained
    and a changed file at vocab_path is caught), else the one a previous run wrote, else trained there on a
    seeded sample of the train split (spilled to disk first, so the split is never whole in memory).

    On many processes only process 0 trains or copies; the others wait for its file (the workdir is shared).
    A workdir on object storage keeps the model's local copy in files.local_directory (sentencepiece opens
    a local file)."""
    path = os.path.join(workdir, VOCABULARY_FILE)
    local = os.path.join(files.local_directory(workdir, config.local_cache_dir), VOCABULARY_FILE)
    process_index = jax.process_index() if process_index is None else process_index
    if config.vocab_path:
        return given_tokenizer(config.vocab_path, path, process_index, local)
    if process_index != 0:
        wait_for_file(path, "vocabulary")
    if files.exists(path):  # written by an earlier start of this run: resume with the same ids
        tokenizer = local_tokenizer(path, local)
        if (tokenizer.vocab_size, tokenizer.model_type) != (config.vocab_size, config.vocab_model_type):
            raise DataError(f"{path} is a {tokenizer.model_type} vocabulary of {tokenizer.vocab_size} pieces but "
                            f"data.vocab_model_type={config.vocab_model_type!r}, data.vocab_size={config.vocab_size}:"
                            " this workdir belongs to another run; use a new --workdir")
        return tokenizer
    sentences = as_split_source(train, "train").sentences(os.path.join(os.path.dirname(local), "tokens"))
    start = time.perf_counter()
    tokenizer = train_tokenizer(sentences, local, vocab_size=config.vocab_size, model_type=config.vocab_model_type,
                                character_coverage=config.vocab_character_coverage,
                                max_sentences=config.vocab_max_sentences, max_characters=config.vocab_max_characters,
                                control_symbols=(SYNTHETIC_TAG,) if config.tag_synthetic else ())
    files.publish(local, path)
    log.info("trained the %s vocabulary %s in %.1fs", config.vocab_model_type, path, time.perf_counter() - start)
    return tokenizer


def local_tokenizer(path: str, local: str) -> Tokenizer:
    """The tokenizer of the model at `path`, read from its local copy `local` (fetched when missing or stale)."""
    if local != path and (not os.path.exists(local) or fingerprint(local) != fingerprint(path)):
        files.fetch(path, local)
    return Tokenizer(local)


def given_tokenizer(vocab_path: str, path: str, process_index: int, local: str | None = None) -> Tokenizer:
    """data.vocab_path, loaded from its copy at `path` in the workdir: made by process 0 on first use,
    refused if a copy already there has other bytes (the workdir's run was trained with another vocabulary)."""
    local = local or path
    if not files.exists(vocab_path):
        raise DataError(f"data.vocab_path={vocab_path} does not exist")
    if process_index != 0:
        wait_for_file(path, "vocabulary", hint=f" (process 0 copies data.vocab_path={vocab_path} there)")
    elif not files.exists(path):
        checked = vocab_path if files.is_local(vocab_path) else local + ".given"  # sentencepiece reads local files
        files.fetch(vocab_path, checked)
        Tokenizer(checked)  # refuses a model with other special ids before it enters the workdir
        files.make_dirs(os.path.dirname(path) or ".")
        files.copy_file(checked, path)
        if checked != vocab_path:
            os.remove(checked)
    given, kept = fingerprint(vocab_path), fingerprint(path)
    if given != kept:
        raise VocabularyMismatchError(f"data.vocab_path={vocab_path} (sha256 {given}) is not {path} (sha256 {kept}), "
                                      "the vocabulary this workdir was started with; use a new --workdir, or "
                                      "restore that file")
    return local_tokenizer(path, local)


def bucket_length(length: int, minimum: int = 8) -> int:
    """The next power of two >= length: few distinct shapes, so few decoder compilations."""
    return max(minimum, 1 << (max(length, 1) - 1).bit_length())


# ----------------------------------------------------------------------------------------------------
# Training: a token cache (transformer/token_cache.py), then a grain pipeline over it.

MODEL_KEYS = ("inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position",
              "targets_position")
def load_or_build_token_cache(train: SplitSource | list[tuple[str, str]], tokenizer: Tokenizer, workdir: str,
                              split: str, *, num_workers: int = 0, process_index: int | None = None,
                              timeout_seconds: float = 3600.0, local_root: str = "",
                              prefix: tuple[int, ...] = ()) -> TokenCache:
    """The split's cache in the workdir, found by the split's fingerprint: process 0 builds it if absent (and
    only then reads the split), the other processes wait for it. The cache is memory-mapped, so a workdir on
    object storage holds a published copy and each host maps its fetched local one. `prefix`: ids put before
    every source (a synthetic corpus's tag), part of the cache's name."""
    source = as_split_source(train, split)
    record = cache_record(tokenizer.path, {**source.fingerprint, "input_prefix": list(prefix)} if prefix
                          else source.fingerprint)
    directory = cache_directory(workdir, split, record)
    local = cache_directory(files.local_directory(workdir, local_root), split, record)
    process_index = jax.process_index() if process_index is None else process_index
    published = os.path.join(directory, SOURCE_FILE)  # published last: its presence means the copy is whole
    if not os.path.isdir(local) and (process_index != 0 or files.exists(published)):
        if process_index != 0:
            wait_for_file(directory if local == directory else published, f"{split} token cache", timeout_seconds,
                          hint=(" Else this process sees another source than process 0: the cache is named by the"
                                " source files' paths, sizes and modification times, which must be the same for"
                                " every process."))
        fetch_cache(directory, local)
    elif not os.path.isdir(local):
        start = time.perf_counter()
        TokenCache.build(source.spill(os.path.dirname(local)),
                         tokenizer.path, local, num_workers=num_workers, record=record, prefix=prefix)
        log.info("tokenized the %s split into %s in %.1fs", split, local, time.perf_counter() - start)
    check_cache_record(local, record)
    if local != directory and not files.exists(published) and process_index == 0:
        for name in (*CACHE_FILES, SOURCE_FILE):
            files.publish(os.path.join(local, name), os.path.join(directory, name))
    return TokenCache(local)


@dataclasses.dataclass(frozen=True)
class LengthFilter:
    """Which pairs of a cache fit in max_length tokens on both sides, and how many were dropped."""

    kept: np.ndarray  # int64 [num_kept] indices into the cache
    too_long: int

    @classmethod
    def of(cls, cache: TokenCache, max_length: int) -> "LengthFilter":
        fits = (cache.lengths("inputs") <= max_length) & (cache.lengths("targets") <= max_length)
        return cls(np.flatnonzero(fits), int(len(fits) - fits.sum()))


def first_fit(input_lengths: np.ndarray, target_lengths: np.ndarray, *, rows: int, max_length: int,
              max_misses: int = 16, pack: bool = True) -> list[list[list[int]]]:
    """Pack pairs (given by their lengths, in order) into batches of `rows` rows of max_length tokens per
    side: each pair goes to the first row where both sides fit (pack=False: the first empty row, one pair per
    row). A pair that fits nowhere waits for the next batch; a batch closes after max_misses such pairs in a row. Every pair lands in exactly one row; the
    last batch may hold fewer rows. Returns batches -> rows -> pair positions."""
    batches, waiting, position, count = [], [], 0, len(input_lengths)
    while waiting or position < count:
        free_inputs, free_targets = np.full(rows, max_length), np.full(rows, max_length)
        contents: list[list[int]] = [[] for _ in range(rows)]
        queue, waiting, misses = waiting, [], 0
        while misses < max_misses:
            if queue:
                pair = queue.pop(0)
            elif position < count:
                pair, position = position, position + 1
            else:
                break
            fits = (free_inputs >= input_lengths[pair]) & (free_targets >= target_lengths[pair])
            if not pack:
                fits &= free_inputs == max_length
            row = int(fits.argmax())
            if fits[row]:
                contents[row].append(pair)
                free_inputs[row] -= input_lengths[pair]
                free_targets[row] -= target_lengths[pair]
                misses = 0
            else:
                waiting.append(pair)
                misses += 1
        waiting = queue + waiting  # carried pairs not yet tried keep their place in front
        batches.append([row for row in contents if row])
    return batches


def pair_tokens(cache: TokenCache, side: str, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One side's tokens of the cache pairs `pairs`, concatenated in that order (int32, one numpy gather), each
    pair's length, and each token's position within its pair."""
    flat, offsets = cache.arrays[side], cache.arrays["input_offsets" if side == "inputs" else "target_offsets"]
    starts, lengths = offsets[pairs], offsets[pairs + 1] - offsets[pairs]
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.asarray(flat[np.repeat(starts, lengths) + within], np.int32), lengths, within


def assemble(cache: TokenCache, rows: list[list[int]], num_rows: int, max_length: int) -> Batch:
    """Packed arrays [num_rows, max_length] of the cache pairs in `rows`, gathered by numpy without a
    Python loop over tokens; rows beyond len(rows) are padding."""
    pairs = np.fromiter((p for row in rows for p in row), np.int64)
    row_of = np.repeat(np.arange(len(rows)), [len(row) for row in rows])
    first_of_row = np.searchsorted(row_of, row_of)  # index of the first pair of each pair's row
    segment = np.arange(len(pairs)) - first_of_row + 1
    batch = {}
    for side in ("inputs", "targets"):
        tokens, lengths, within = pair_tokens(cache, side, pairs)
        before = np.cumsum(lengths) - lengths  # tokens of all earlier pairs
        column = before - before[first_of_row]  # a pair's first column: the pairs before it in its row
        destination = np.repeat(row_of * max_length + column, lengths) + within
        values = {side: tokens, f"{side}_segmentation": np.repeat(segment, lengths), f"{side}_position": within}
        for key, value in values.items():
            array = np.zeros(num_rows * max_length, np.int32)
            array[destination] = value
            batch[key] = array.reshape(num_rows, max_length)
    return batch


def eval_batches(cache: TokenCache, kept: np.ndarray, *, max_length: int, rows_per_batch: int,
                 pack: bool = True) -> list[Batch]:
    """The pairs `kept` of a cache, in order, packed as training packs them; every batch has the same shape
    (the last is padded with empty rows)."""
    batches = first_fit(cache.lengths("inputs")[kept], cache.lengths("targets")[kept], rows=rows_per_batch,
                        max_length=max_length, pack=pack)
    return [assemble(cache, [[int(kept[p]) for p in row] for row in batch], rows_per_batch, max_length)
            for batch in batches]


class PackChunk:
    """grain map: chunk number -> this process's rows of the packed batches of that chunk.

    Chunk c is chunk c % chunks_per_epoch of epoch c // chunks_per_epoch; epoch e visits the kept pairs in
    the order of permutation(seed, e). Every process computes the same packing plan for the whole global
    batch (first_fit on the cached lengths: cheap) and gathers the tokens of its own block of rows only, so
    the processes' parts are disjoint and together complete, and the global batches are the same whatever the
    number of processes (a 2-process run trains exactly like a 1-process run). A chunk is packed on its own,
    so workers build chunks in parallel and the stream has random access by chunk; its last batch may be
    partly padding. Picklable: the cache pickles as its path."""

    def __init__(self, cache: TokenCache, kept: np.ndarray, *, seed: int, shard: "Shard", rows: int,
                 max_length: int, chunk_pairs: int, pack: bool = True):
        self.cache, self.kept, self.seed, self.shard, self.pack = cache, kept, seed, shard, pack
        self.rows, self.max_length, self.chunk_pairs = rows, max_length, chunk_pairs  # rows: global per batch
        self.local_rows = local_rows(rows, shard)
        self.chunks_per_epoch = -(-len(kept) // chunk_pairs)
        self._epoch, self._order = None, None

    def __getstate__(self):
        return {**self.__dict__, "_epoch": None, "_order": None}

    def order(self, epoch: int) -> np.ndarray:
        """The cache indices of the kept pairs in epoch `epoch`, in visiting order."""
        if self._epoch != epoch:  # one permutation per epoch, not per chunk
            permutation = np.random.default_rng([self.seed, epoch]).permutation(len(self.kept))
            self._epoch, self._order = epoch, self.kept[permutation]
        return self._order

    def __call__(self, chunk: int) -> list[Batch]:
        epoch, index = divmod(int(chunk), self.chunks_per_epoch)
        pairs = self.order(epoch)[index * self.chunk_pairs:(index + 1) * self.chunk_pairs]
        batches = first_fit(self.cache.lengths("inputs")[pairs], self.cache.lengths("targets")[pairs],
                            rows=self.rows, max_length=self.max_length, pack=self.pack)
        first = self.shard.index * self.local_rows  # this process's block of rows of each global batch
        return [assemble(self.cache, [[int(pairs[p]) for p in row] for row in batch[first:first + self.local_rows]],
                         self.local_rows, self.max_length)
                for batch in batches]


class FlattenIterator(grain.DatasetIterator):
    """Lists of batches -> batches. Its state (the parent's state before the current list, and how many of
    its batches were taken) restores to exactly the next batch."""

    def __init__(self, parent: grain.DatasetIterator):
        super().__init__(parent)
        self._parent_state, self._batches, self._taken = self._parent.get_state(), None, 0

    def __next__(self) -> Batch:
        while self._batches is None or self._taken >= len(self._batches):
            self._parent_state = self._parent.get_state()
            self._batches, self._taken = next(self._parent), 0
        self._taken += 1
        return self._batches[self._taken - 1]

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._parent_state, "taken": self._taken}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._parent_state, self._batches, self._taken = state["parent"], None, 0
        if state["taken"]:
            self._batches, self._taken = next(self._parent), state["taken"]

    def close(self) -> None:
        if hasattr(self._parent, "close"):
            self._parent.close()


class Flatten(grain.IterDataset):
    def __iter__(self) -> FlattenIterator:
        return FlattenIterator(self._parent.__iter__())


@dataclasses.dataclass(frozen=True)
class Shard:
    """This process's part of the data: block `index` of `count` equal blocks of rows of each global batch."""

    index: int = 0
    count: int = 1

    @classmethod
    def of_process(cls) -> "Shard":
        options = grain.sharding.ShardByJaxProcess()
        return cls(options.shard_index, options.shard_count)


def local_rows(rows_per_batch: int, shard: Shard) -> int:
    """Rows this process builds of each global batch of rows_per_batch rows."""
    if rows_per_batch % shard.count:
        raise DataError(f"{rows_per_batch} rows per batch (data.tokens_per_batch // data.max_length) do not split "
                        f"evenly over {shard.count} processes; make tokens_per_batch a multiple of "
                        f"{shard.count} * max_length")
    return rows_per_batch // shard.count


def train_dataset(cache: TokenCache, kept: np.ndarray, *, seed: int, max_length: int, rows_per_batch: int,
                  shard: Shard = Shard(), num_workers: int = 0, chunk_batches: int = 64,
                  pack: bool = True) -> grain.IterDataset:
    """Endless packed batches [rows_per_batch / shard.count, max_length] of this process's shard.

    grain gives the random access by chunk, the worker processes and the checkpointable state. Packing is
    ours (`first_fit`, `assemble`): grain's FirstFitPackIterDataset spends a hundred times more Python per pair
    than packing on the cached lengths and gathering with numpy (docs/benchmarks.md)."""
    if len(kept) == 0:
        raise DataError("no training pairs left after length filtering; raise data.max_length")
    mean_length = float(np.maximum(cache.lengths("inputs")[kept], cache.lengths("targets")[kept]).mean())
    chunk_pairs = max(int(chunk_batches * rows_per_batch * (max_length / mean_length if pack else 1)), 1)
    packer = PackChunk(cache, kept, seed=seed, shard=shard, rows=rows_per_batch, max_length=max_length,
                       chunk_pairs=chunk_pairs, pack=pack)
    # num_threads=0: chunks are computed from memory; reader threads would only contend for the GIL.
    dataset = grain.MapDataset.range(2**62).map(packer).to_iter_dataset(grain.ReadOptions(num_threads=0))
    return Flatten(in_worker_processes(dataset, num_workers))


def batch_shapes(rows_per_batch: int, max_length: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of a (global) training batch: what the steps are compiled for."""
    return {key: jax.ShapeDtypeStruct((rows_per_batch, max_length), np.int32) for key in MODEL_KEYS}


def packing_stats(batch: Batch) -> dict[str, float]:
    """Padding fraction of each side and the number of sentence pairs in a packed batch."""
    return {"inputs_padding": float((batch["inputs_segmentation"] == 0).mean()),
            "targets_padding": float((batch["targets_segmentation"] == 0).mean()),
            "pairs": int(batch["targets_segmentation"].max(axis=1).sum())}


def iterator_state_json(iterator: grain.DatasetIterator) -> bytes:
    return json.dumps(iterator.get_state()).encode()


def restore_iterator(iterator: grain.DatasetIterator, state: bytes | dict[str, Any]) -> None:
    iterator.set_state(json.loads(state) if isinstance(state, (bytes, str)) else state)
