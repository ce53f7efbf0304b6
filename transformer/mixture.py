"""Training data from several corpora, and its cleaning: data.mixture's weighted sources (each tokenized once into
its own token cache, sampled by weight into the same packed batches) and data.filter_*'s named filters.

A mixture is a list of `WEIGHT:KIND[:WHERE]` entries (transformer/defaults.py): main, text:DIR, synthetic:DIR,
tfds:NAME or builtin:SEED. Source i gets the share
w_i / sum(w) of the training pairs, exactly: chunk c of the stream takes the pairs floor(c P s_i) up to
floor((c + 1) P s_i) of source i's own endless stream (epochs of a permutation of its kept pairs, reseeded each
epoch), P pairs per chunk, shuffles them together and packs them as data.py packs one source. Quotas, not a draw
per pair (fairseq's and seqio's sampling): the shares then hold in every chunk, not only on average, and chunk c
is still a function of c alone, so grain keeps its random access by chunk, its worker processes and its
checkpointable state, and a resume is bitwise as with one source. Without data.mixture, data.py's single-source
path runs unchanged.

The filters work on the token cache, so changing one never tokenizes a corpus again: a length ratio and a
character limit on each side, exact duplicate pairs (all but the first) and copies (source equal to target), each
counted on its own (a pair may fail several). Equality is of the token ids (a shared vocabulary's ids of the
text sentencepiece normalises), and characters are those of the normalised text; see `clean`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from transformer import data
from transformer.console import log
from transformer.errors import DataError
from transformer.token_cache import TokenCache, in_worker_processes
from transformer.tokenizer import SYNTHETIC_TAG, UNK_ID, Tokenizer

KINDS = ("main", "text", "synthetic", "tfds", "builtin")
SOURCE_TOKENS = "source_tokens"  # a mixture batch's extra key: target tokens of each source in the global batch
_HASH_BLOCK = 1 << 20  # pairs hashed at a time: bounds the filters' memory on a WMT-sized cache


@dataclasses.dataclass(frozen=True)
class Entry:
    """One source of a mixture: its weight, its kind and where it is (a folder or a TFDS name)."""

    weight: float
    kind: str
    where: str = ""

    @property
    def synthetic(self) -> bool:
        return self.kind == "synthetic"


def parse(spec: str) -> list[Entry]:
    """data.mixture -> its entries; a DataError names the entry at fault."""
    entries = []
    for text in (part.strip() for part in spec.split(",")):
        weight, _, rest = text.partition(":")
        kind, _, where = rest.partition(":")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise DataError(f"data.mixture entry {text!r}: {weight!r} is not a weight > 0 (an entry is "
                            "WEIGHT:KIND[:WHERE], e.g. 1:main or 0.5:synthetic:runs/bt)")
        if kind not in KINDS:
            raise DataError(f"data.mixture entry {text!r}: the kind {kind!r} is not one of {KINDS}")
        if (kind == "main") == bool(where):
            raise DataError(f"data.mixture entry {text!r}: " + (
                "main is the source of data.source and takes no location" if where else
                f"{kind} needs a location ({kind}:{ {'tfds': 'NAME', 'builtin': 'SEED'}.get(kind, 'DIR')})"))
        if kind == "builtin" and not where.isdigit():
            raise DataError(f"data.mixture entry {text!r}: builtin takes the generator's seed, an integer >= 0")
        if any((e.kind, e.where) == (kind, where) for e in entries):
            raise DataError(f"data.mixture lists {kind}{':' + where if where else ''} twice; give it one weight")
        entries.append(Entry(value, kind, where))
    if sum(entry.kind == "main" for entry in entries) != 1:
        raise DataError(f"data.mixture={spec!r} must list the main source (data.source, which also gives the "
                        "vocabulary, valid and test) once, e.g. 1:main")
    return entries


def labels(entries: Sequence[Entry]) -> list[str]:
    """Short names for logs and metrics: the kind, numbered where a kind repeats (text1, text2)."""
    kinds = [entry.kind for entry in entries]
    numbers = [kinds[:index].count(kind) + 1 for index, kind in enumerate(kinds)]
    return [kind if kinds.count(kind) == 1 else f"{kind}{number}" for kind, number in zip(kinds, numbers)]


def entry_config(config: data.DataConfig, entry: Entry) -> data.DataConfig:
    """The data config that reads `entry`'s train split through data.py's readers."""
    if entry.kind == "main":
        return config
    if entry.kind == "tfds":
        return dataclasses.replace(config, source="tfds", tfds_name=entry.where)
    if entry.kind == "builtin":  # the built-in grammar with another seed, at data.builtin_train_size
        return dataclasses.replace(config, source="builtin", builtin_seed=int(entry.where))
    return dataclasses.replace(config, source="text", text_dir=entry.where)


def input_prefix(entry: Entry, config: data.DataConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids put before each of the entry's sources: the synthetic tag where data.tag_synthetic asks for it."""
    if not (config.tag_synthetic and entry.synthetic):
        return ()
    if tokenizer.synthetic_tag is None:
        raise DataError(f"data.tag_synthetic needs a vocabulary with the control piece {SYNTHETIC_TAG}, and "
                        f"{tokenizer.path} has none (trained without data.tag_synthetic, or given by data.vocab_path "
                        "or train.init_from): train a new one, with data.tag_synthetic=true from the first start")
    return (tokenizer.synthetic_tag,)


# ----------------------------------------------------------------------------------------------------
# Cleaning.


@dataclasses.dataclass(frozen=True)
class Cleaned:
    """The pairs of a cache that pass every filter, and how many each filter dropped."""

    kept: np.ndarray  # int64 indices into the cache
    dropped: dict[str, int]  # filter -> pairs failing it (a pair may fail several)
    total: int

    def line(self, name: str) -> str:
        dropped = ", ".join(f"{count} {what}" for what, count in self.dropped.items())
        return f"train {name}: {len(self.kept)} of {self.total} pairs kept; dropped: {dropped}"


def clean(cache: TokenCache, config: data.DataConfig, tokenizer: Tokenizer | None = None,
          skip: int = 0) -> Cleaned:
    """The length filter (data.max_length) and the cleaning filters data.filter_* on a cache whose sources begin
    with `skip` tag ids (left out of every comparison).

    Ratio: the two sides' token counts, without EOS and tag, differ by more than data.filter_max_ratio times.
    Duplicates and copies: equal token ids, found by a 64-bit hash of each side (odd random multipliers per
    position, summed mod 2^64, with the length; a false match among 10^7 pairs has odds near 10^-5). Characters:
    a side's length in the text sentencepiece normalises (its pieces' characters, an unknown piece one), which
    is the raw text's for text without odd spaces or compatibility characters."""
    inputs, targets = cache.lengths("inputs"), cache.lengths("targets")
    fails = {f"longer than {config.max_length} tokens": (inputs > config.max_length) | (targets > config.max_length)}
    if config.filter_max_ratio:
        source, target = np.maximum(inputs - 1 - skip, 1), np.maximum(targets - 1, 1)
        fails[f"with a length ratio over {config.filter_max_ratio:g}"] = (
            np.maximum(source, target) > config.filter_max_ratio * np.minimum(source, target))
    if config.filter_duplicates or config.filter_copies:
        source_hash, target_hash = side_hashes(cache, "inputs", skip), side_hashes(cache, "targets")
        if config.filter_duplicates:
            _, first = np.unique(np.stack([source_hash, target_hash], axis=1), axis=0, return_index=True)
            repeated = np.ones(len(inputs), bool)
            repeated[first] = False
            fails["duplicates"] = repeated
        if config.filter_copies:
            fails["copies (source = target)"] = source_hash == target_hash
    if config.filter_language:
        fails[f"not identified as {config.source_lang} -> {config.target_lang}"] = ~identified(
            cache, tokenizer, config.source_lang, config.target_lang, skip)
    if config.filter_max_characters:
        if tokenizer is None:
            raise ValueError("data.filter_max_characters needs the tokenizer (its pieces' characters)")
        table = piece_characters(tokenizer)
        longest = np.maximum(side_sums(cache, "inputs", table, skip), side_sums(cache, "targets", table))
        fails[f"over {config.filter_max_characters} characters"] = longest > config.filter_max_characters
    bad = np.logical_or.reduce(list(fails.values()))
    return Cleaned(np.flatnonzero(~bad), {what: int(mask.sum()) for what, mask in fails.items()}, len(inputs))


def identified(cache: TokenCache, tokenizer: Tokenizer | None, source_lang: str, target_lang: str,
               skip: int = 0) -> np.ndarray:
    """Whether py3langid (a langid.py model that ships in its wheel: no download at run time) names each side's
    text, decoded from the cache, as its language. The mask is kept beside a cache on disk, since identifying WMT14's
    9M sentences takes about half an hour of one core (5,600-9,000 lines/s measured on Europarl and Multi30k)."""
    saved = f"{cache.directory}.language-{source_lang}-{target_lang}.npy" if cache.directory else None
    if saved and os.path.exists(saved):
        return np.load(saved)
    try:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier  # pylint: disable=g-import-not-at-top
    except ImportError as error:
        raise DataError("data.filter_language needs py3langid: pip install -e '.[langid]'") from error
    if tokenizer is None:
        raise ValueError("data.filter_language needs the tokenizer (it identifies the decoded text)")
    identifier = LanguageIdentifier.from_model_file(MODEL_FILE)
    for lang in (source_lang, target_lang):
        if lang not in set(identifier.nb_classes):
            raise DataError(f"data.filter_language: py3langid does not know the language {lang!r}")
    masks = []
    for side, lang, first in (("inputs", source_lang, skip), ("targets", target_lang, 0)):
        offsets = cache.arrays["input_offsets" if side == "inputs" else "target_offsets"]
        flat, found = cache.arrays[side], []
        for start in range(0, len(offsets) - 1, _HASH_BLOCK):
            ends = np.asarray(offsets[start:start + _HASH_BLOCK + 1], np.int64)
            ids = [np.asarray(flat[a + first:b - 1]).tolist() for a, b in zip(ends[:-1], ends[1:])]
            texts = tokenizer.decode_lists(ids, "source" if side == "inputs" else "target")
            found += [identifier.classify(text)[0] == lang for text in texts]
        masks.append(np.asarray(found, bool))
    mask = masks[0] & masks[1]
    if saved:
        np.save(saved + ".tmp.npy", mask)
        os.replace(saved + ".tmp.npy", saved)
    return mask


def _blocks(cache: TokenCache, side: str):
    """(flat tokens, offsets rebased to them, position of each token in its sentence) per block of pairs."""
    offsets = cache.arrays["input_offsets" if side == "inputs" else "target_offsets"]
    for start in range(0, len(offsets) - 1, _HASH_BLOCK):
        block = np.asarray(offsets[start:start + _HASH_BLOCK + 1], np.int64)
        flat = np.asarray(cache.arrays[side][block[0]:block[-1]], np.uint64)
        lengths = np.diff(block)
        yield flat, block - block[0], np.arange(len(flat)) - np.repeat(block[:-1] - block[0], lengths)


def _segment_sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    totals = np.concatenate([np.zeros(1, values.dtype), np.cumsum(values, dtype=values.dtype)])
    return totals[offsets[1:]] - totals[offsets[:-1]]  # uint64 wraps: the sums are mod 2^64


def side_hashes(cache: TokenCache, side: str, skip: int = 0) -> np.ndarray:
    """A uint64 hash of each pair's ids on one side, the first `skip` left out (so a tagged source hashes as
    its untagged text)."""
    longest = int(cache.lengths(side).max(initial=0)) + 1
    multipliers = np.random.default_rng(20190401).integers(0, 2**63, longest, dtype=np.uint64) * np.uint64(2) + 1
    hashes = []
    with np.errstate(over="ignore"):
        for flat, offsets, position in _blocks(cache, side):
            shifted = np.maximum(position - skip, 0)
            values = np.where(position >= skip, (flat + np.uint64(1)) * multipliers[shifted], np.uint64(0))
            counted = np.diff(offsets) - skip
            hashes.append(_segment_sums(values, offsets) * np.uint64(0x9E3779B97F4A7C15) + counted.astype(np.uint64))
    return np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)


def piece_characters(tokenizer: Tokenizer) -> np.ndarray:
    """Characters of each piece's text ("▁" a space; special and control pieces none, an unknown one)."""
    table = np.zeros(tokenizer.vocab_size, np.int64)
    for piece in range(len(table)):
        if piece == UNK_ID:
            table[piece] = 1
        elif not tokenizer.is_special(piece):
            table[piece] = len(tokenizer.id_to_piece(piece))
    return table


def side_sums(cache: TokenCache, side: str, table: np.ndarray, skip: int = 0) -> np.ndarray:
    """Characters of each pair's side: its pieces' characters, less the one space sentencepiece puts in front."""
    sums = [_segment_sums(np.where(position >= skip, table[flat.astype(np.int64)], 0), offsets)
            for flat, offsets, position in _blocks(cache, side)]
    return np.maximum(np.concatenate(sums) - 1, 0) if sums else np.zeros(0, np.int64)


# ----------------------------------------------------------------------------------------------------
# The mixed stream.


@dataclasses.dataclass(frozen=True)
class Source:
    """A mixture's source ready to train on: its label, weight, cache and kept pairs."""

    label: str
    weight: float
    cache: TokenCache
    kept: np.ndarray


def gather(caches: Sequence[TokenCache], indices: Sequence[np.ndarray]) -> TokenCache:
    """The pairs indices[i] of caches[i], in that order, as one cache in memory (numpy gathers, no loop per pair)."""
    arrays: dict[str, np.ndarray] = {}
    for side, offsets_name in (("inputs", "input_offsets"), ("targets", "target_offsets")):
        parts = [data.pair_tokens(cache, side, chosen)[:2] for cache, chosen in zip(caches, indices)]
        arrays[side] = np.concatenate([tokens for tokens, _ in parts])
        arrays[offsets_name] = np.concatenate([[0], np.cumsum(np.concatenate([lengths for _, lengths in parts]))])
    return TokenCache(None, arrays)


class MixChunk:
    """grain map: chunk number -> this process's rows of the packed batches of that chunk of the mixture, each
    batch with SOURCE_TOKENS (the target tokens of each source in the whole global batch, counted from the
    packing plan every process computes, so no process needs another's rows). Picklable for grain workers."""

    def __init__(self, sources: Sequence[Source], *, seed: int, shard: data.Shard, rows: int, max_length: int,
                 chunk_pairs: int, pack: bool = True):
        self.caches, self.kept = [s.cache for s in sources], [s.kept for s in sources]
        weights = np.asarray([s.weight for s in sources], np.float64)
        self.shares = weights / weights.sum()
        self.seed, self.shard, self.rows, self.max_length, self.pack = seed, shard, rows, max_length, pack
        self.chunk_pairs, self.local_rows = chunk_pairs, data.local_rows(rows, shard)
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def __getstate__(self):
        return {**self.__dict__, "_orders": {}}

    def quota(self, source: int, chunk: int) -> tuple[int, int]:
        """The positions [start, stop) of source's own stream that chunk `chunk` takes."""
        share = self.chunk_pairs * self.shares[source]
        return math.floor(chunk * share), math.floor((chunk + 1) * share)

    def stream(self, source: int, start: int, stop: int) -> np.ndarray:
        """Cache indices at positions [start, stop) of source's endless stream of reshuffled epochs."""
        kept, parts = self.kept[source], []
        for epoch in range(start // len(kept), -(-stop // len(kept))):
            if (source, epoch) not in self._orders:
                if len(self._orders) > 4 * len(self.kept):  # a few epochs per source are ever in use at once
                    self._orders.clear()
                permutation = np.random.default_rng([self.seed, 1, source, epoch]).permutation(len(kept))
                self._orders[source, epoch] = kept[permutation]
            low, high = max(start - epoch * len(kept), 0), min(stop - epoch * len(kept), len(kept))
            parts.append(self._orders[source, epoch][low:high])
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def __call__(self, chunk: int) -> list[data.Batch]:
        chosen = [self.stream(i, *self.quota(i, int(chunk))) for i in range(len(self.caches))]
        label = np.repeat(np.arange(len(chosen)), [len(c) for c in chosen])
        order = np.random.default_rng([self.seed, 2, int(chunk)]).permutation(len(label))
        pairs = gather(self.caches, chosen)
        inputs, targets = pairs.lengths("inputs")[order], pairs.lengths("targets")[order]
        batches = data.first_fit(inputs, targets, rows=self.rows, max_length=self.max_length, pack=self.pack)
        first, out = self.shard.index * self.local_rows, []
        for batch in batches:
            everywhere = np.fromiter((p for row in batch for p in row), np.int64)
            batch_ = data.assemble(pairs, [[int(order[p]) for p in row] for row in batch[first:first + self.local_rows]],
                                   self.local_rows, self.max_length)
            batch_[SOURCE_TOKENS] = np.bincount(label[order[everywhere]], weights=targets[everywhere],
                                                minlength=len(self.caches)).astype(np.int64)
            out.append(batch_)
        return out


def train_dataset(sources: Sequence[Source], *, seed: int, max_length: int, rows_per_batch: int,
                  shard: data.Shard = data.Shard(), num_workers: int = 0, chunk_batches: int = 64,
                  pack: bool = True) -> grain.IterDataset:
    """Endless packed batches of the mixture, as data.train_dataset's of one source (same shapes, plus
    SOURCE_TOKENS)."""
    for source in sources:
        if not len(source.kept):
            raise DataError(f"the mixture's source {source.label} has no training pairs left after its filters")
    weights = np.asarray([s.weight for s in sources]) / sum(s.weight for s in sources)
    mean_length = sum(w * float(np.maximum(s.cache.lengths("inputs")[s.kept], s.cache.lengths("targets")[s.kept]).mean())
                      for w, s in zip(weights, sources))
    chunk_pairs = max(int(chunk_batches * rows_per_batch * (max_length / mean_length if pack else 1)), 1)
    packer = MixChunk(sources, seed=seed, shard=shard, rows=rows_per_batch, max_length=max_length,
                      chunk_pairs=chunk_pairs, pack=pack)
    dataset = grain.MapDataset.range(2**62).map(packer).to_iter_dataset(grain.ReadOptions(num_threads=0))
    return data.Flatten(in_worker_processes(dataset, num_workers))


class Shares:
    """Each source's share of the target tokens over a log window, from the batches' SOURCE_TOKENS (popped, so
    the batch that reaches the devices holds the model's keys only)."""

    def __init__(self, names: Sequence[str]):
        self.names, self.tokens = list(names), np.zeros(len(names), np.int64)

    def take(self, batch: dict[str, Any]) -> dict[str, Any]:
        counts = batch.pop(SOURCE_TOKENS, None)
        if counts is not None:
            self.tokens += counts
        return batch

    def summary(self) -> dict[str, float]:
        total, tokens = max(int(self.tokens.sum()), 1), self.tokens
        self.tokens = np.zeros(len(self.names), np.int64)
        return {f"share_{name}": float(count) / total for name, count in zip(self.names, tokens)}


def fingerprints(config: data.DataConfig) -> list[dict[str, Any] | None]:
    """Each entry's train split fingerprint (None for main, which the trainer fingerprints itself), found without
    reading it: a missing folder, file or dataset fails here, before any corpus is read or tokenized."""
    return [None if entry.kind == "main" else data.split_fingerprint(entry_config(config, entry), "train")
            for entry in parse(config.mixture)]


def load_sources(config: data.DataConfig, tokenizer: Tokenizer, workdir: str, main: Source,
                 found: Sequence[dict[str, Any] | None]) -> list[Source]:
    """data.mixture's sources, `main` (the main source's cache, cleaned) among them in its place: each other one,
    known by its fingerprint in `found` (`fingerprints`), tokenized into its own cache (once; process 0 builds, the
    others wait) and cleaned, with its counts logged."""
    entries, sources = parse(config.mixture), []
    for entry, label, fingerprint in zip(entries, labels(entries), found):
        if entry.kind == "main":
            sources.append(dataclasses.replace(main, label=label, weight=entry.weight))
            continue
        prefix = input_prefix(entry, config, tokenizer)
        with data.SplitSource("train", fingerprint, data.iter_split(entry_config(config, entry), "train")) as split:
            cache = data.load_or_build_token_cache(split, tokenizer, workdir, "train", num_workers=config.num_workers,
                                                   local_root=config.local_cache_dir, prefix=prefix)
        cleaned = clean(cache, config, tokenizer, skip=len(prefix))
        log.info("%s (%s, weight %g%s)", cleaned.line(label), entry.where, entry.weight,
                 ", tagged" if prefix else "")
        sources.append(Source(label, entry.weight, cache, cleaned.kept))
    return sources
