"""The token cache: a split's sentence pairs tokenized once into flat arrays plus offsets on disk, memory-mapped
wherever they are read (every process and grain worker), and the pair spill it is built from. data.py decides
when a cache is built or found; this module stores and reads it.

Tokenizing WMT14's 4.5M pairs takes minutes; the cache does it once per workdir (not once per start or epoch) and
keeps the training loop free of sentencepiece. A cache folder is written whole or not at all, and named (in data.py)
by what it came from, which its SOURCE_FILE records and `check_cache_record` compares before any use.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import grain
import numpy as np

from transformer import files
from transformer.errors import DataError
from transformer.tokenizer import Tokenizer
from transformer.workdir import fingerprint

CACHE_FILES = ("inputs.npy", "input_offsets.npy", "targets.npy", "target_offsets.npy")
SOURCE_FILE = "source.json"  # in a cache: the fingerprint of its split and the vocabulary's digest
TOKENIZE_CHUNK = 4096  # pairs per grain element of the tokenizing pass: amortizes worker IPC


class PairSpill:
    """Sentence pairs as UTF-8 bytes plus offsets on disk, memory-mapped: a split streamed in once, then read
    by random access (the vocabulary's sample, the tokenizing pass's chunks, in any grain worker: it pickles
    as its directory). numpy rather than a record format, because a chunk of consecutive pairs is then one
    slice of the map."""

    SIDES = ("source", "target")

    def __init__(self, directory: str):
        self.directory = directory
        self._arrays = None

    def __getstate__(self):
        return {"directory": self.directory, "_arrays": None}

    @classmethod
    def write(cls, pairs: Iterable[tuple[str, str]], directory: str, batch_size: int = 65536) -> "PairSpill":
        """Stream `pairs` into `directory` holding only their lengths in memory; a failure removes it."""
        os.makedirs(directory, exist_ok=True)  # a crashed start of the same pid (containers) left it: overwritten
        lengths: dict[str, list[np.ndarray]] = {side: [np.zeros(1, np.int64)] for side in cls.SIDES}
        try:
            with files.naming(directory), open(os.path.join(directory, "source.bin"), "wb") as source, \
                    open(os.path.join(directory, "target.bin"), "wb") as target:
                iterator = iter(pairs)
                while batch := list(itertools.islice(iterator, batch_size)):
                    for side, handle, texts in (("source", source, [s for s, _ in batch]),
                                                ("target", target, [t for _, t in batch])):
                        encoded = [text.encode() for text in texts]
                        handle.write(b"".join(encoded))
                        lengths[side].append(np.fromiter(map(len, encoded), np.int64, len(encoded)))
            for side in cls.SIDES:
                with files.naming(directory):
                    np.save(os.path.join(directory, f"{side}_offsets.npy"), np.cumsum(np.concatenate(lengths[side])))
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return cls(directory)

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            self._arrays = {}
            for side in self.SIDES:
                path = os.path.join(self.directory, f"{side}.bin")
                self._arrays[side] = (np.memmap(path, np.uint8, mode="r") if os.path.getsize(path)
                                      else np.zeros(0, np.uint8))  # mmap refuses an empty file
                self._arrays[f"{side}_offsets"] = np.load(os.path.join(self.directory, f"{side}_offsets.npy"))
        return self._arrays

    def __len__(self) -> int:
        return len(self.arrays["source_offsets"]) - 1

    def texts(self, side: str, start: int, stop: int) -> list[str]:
        offsets = self.arrays[f"{side}_offsets"][start:stop + 1]
        raw = self.arrays[side][offsets[0]:offsets[-1]].tobytes() if len(offsets) else b""
        ends = (offsets - offsets[0]).tolist() if len(offsets) else []
        return [raw[a:b].decode() for a, b in zip(ends[:-1], ends[1:])]

    def __getitem__(self, index: slice) -> list[tuple[str, str]]:
        start, stop, _ = index.indices(len(self))
        stop = max(start, stop)
        return list(zip(self.texts("source", start, stop), self.texts("target", start, stop)))

    def sentences(self) -> "SpillSentences":
        return SpillSentences(self)

    def remove(self) -> None:
        self._arrays = None
        shutil.rmtree(self.directory, ignore_errors=True)


class SpillSentences(Sequence):
    """The spill's sentences in the order [source 0, target 0, source 1, ...] (the order the vocabulary's
    sample has always been drawn in, so the same split gives the same vocabulary), one decoded on each access."""

    def __init__(self, spill: PairSpill):
        self.spill = spill

    def __len__(self) -> int:
        return 2 * len(self.spill)

    def __getitem__(self, index: int) -> str:
        pair, side = divmod(int(index), 2)
        return self.spill.texts(PairSpill.SIDES[side], pair, pair + 1)[0]


PARENT_POLL_SECONDS = 0.5


def in_worker_processes(dataset: grain.IterDataset, num_workers: int) -> grain.IterDataset:
    """`dataset` computed in `num_workers` grain worker processes (0: in this one) that exit when their parent
    dies, however it dies: a SIGKILL (an out-of-memory or a scheduler's kill) gives the parent no chance to stop
    them, and orphaned workers would keep their memory, their CPU and multiprocessing's resource tracker."""
    if not num_workers:
        return dataset
    return dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers),
                               worker_init_fn=exit_with_parent)


def exit_with_parent(worker_index: int, worker_count: int) -> None:
    """A grain worker's start (worker_init_fn): a daemon thread that ends the worker once its parent process is
    gone. Polling the parent id rather than PR_SET_PDEATHSIG, which fires when the parent's creating *thread*
    exits, and grain may start workers from a thread that ends before the run does."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)  # no cleanup to run: the parent that would read this worker's outputs is gone
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class TokenizeChunk:
    """pairs -> flat token ids and lengths of each side, `prefix` ids put before every source (the tag of a
    synthetic corpus). Picklable for grain workers: it carries the model's path and loads sentencepiece on first
    use in whichever process runs it."""

    def __init__(self, model_path: str, prefix: tuple[int, ...] = ()):
        self.model_path, self.prefix, self._processor = model_path, tuple(prefix), None

    def __getstate__(self):
        return {"model_path": self.model_path, "prefix": self.prefix, "_processor": None}

    def __call__(self, pairs: list[tuple[str, str]]) -> dict[str, np.ndarray]:
        if self._processor is None:
            self._processor = Tokenizer(self.model_path)
        chunk = {}
        for side, texts in (("inputs", [s for s, _ in pairs]), ("targets", [t for _, t in pairs])):
            ids = self._processor.encode_lists(texts, "source" if side == "inputs" else "target")
            if side == "inputs" and self.prefix:
                ids = [[*self.prefix, *sequence] for sequence in ids]
            chunk[f"{side}_lengths"] = np.fromiter(map(len, ids), np.int64, len(ids))
            # chain.from_iterable walks the ids in C: a fifth faster than a generator over every token.
            chunk[side] = np.fromiter(itertools.chain.from_iterable(ids), np.int32, int(chunk[f"{side}_lengths"].sum()))
        return chunk


class PairChunks:
    """Random access to consecutive chunks of pairs, a list or a PairSpill (the grain source of the tokenizing
    pass)."""

    def __init__(self, pairs: list[tuple[str, str]] | PairSpill, chunk_size: int):
        self.pairs, self.chunk_size = pairs, chunk_size

    def __len__(self) -> int:
        return -(-len(self.pairs) // self.chunk_size)

    def __getitem__(self, index: int) -> list[tuple[str, str]]:
        return self.pairs[index * self.chunk_size:(index + 1) * self.chunk_size]


class TokenCache:
    """The tokenized pairs of one split as flat arrays plus offsets, memory-mapped from `directory`.

    Tokenizing WMT14's 4.5M pairs takes minutes; the cache does it once per workdir (not once per start or
    epoch), keeps the training loop free of sentencepiece, and is shared by every process. Picklable for
    grain workers: it pickles as its directory and maps the files again where it is unpickled."""

    def __init__(self, directory: str | None, arrays: dict[str, np.ndarray] | None = None):
        self.directory = directory  # None: held in memory (`tokenize`)
        self._arrays = arrays

    def __getstate__(self):
        return {"directory": self.directory, "_arrays": None if self.directory else self._arrays}

    @classmethod
    def tokenize(cls, tokenizer: Tokenizer, pairs: list[tuple[str, str]]) -> "TokenCache":
        """A small split (the dev set of the eval loss) tokenized in memory: the same container, packed by the
        same first_fit and assemble, as the train split's."""
        arrays = {}
        for side, offsets, texts in (("inputs", "input_offsets", [s for s, _ in pairs]),
                                     ("targets", "target_offsets", [t for _, t in pairs])):
            sequences = tokenizer.encode(texts, "source" if side == "inputs" else "target")
            arrays[side] = np.concatenate(sequences or [np.zeros(0, np.int32)]).astype(np.int32)
            arrays[offsets] = np.concatenate([[0], np.cumsum([len(x) for x in sequences], dtype=np.int64)])
        return cls(None, arrays)

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            self._arrays = {name[:-4]: np.load(os.path.join(self.directory, name), mmap_mode="r")
                            for name in CACHE_FILES}
        return self._arrays

    def __len__(self) -> int:
        return len(self.arrays["input_offsets"]) - 1

    def lengths(self, side: str) -> np.ndarray:
        return np.diff(self.arrays["input_offsets" if side == "inputs" else "target_offsets"])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        arrays = self.arrays
        return {side: np.asarray(arrays[side][arrays[offsets][index]:arrays[offsets][index + 1]], np.int32)
                for side, offsets in (("inputs", "input_offsets"), ("targets", "target_offsets"))}

    @classmethod
    def build(cls, pairs: list[tuple[str, str]] | PairSpill, model_path: str, directory: str, *,
              num_workers: int = 0, chunk_size: int = TOKENIZE_CHUNK, record: dict | None = None,
              prefix: tuple[int, ...] = ()) -> "TokenCache":
        """Tokenize `pairs` (grain, with num_workers processes), `prefix` before every source, and write the cache
        chunk by chunk."""
        dataset = grain.MapDataset.source(PairChunks(pairs, chunk_size)).map(TokenizeChunk(model_path, prefix))
        dataset = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0))
        dataset = in_worker_processes(dataset, num_workers)
        with files.naming(directory), CacheWriter(directory) as writer:
            iterator = iter(dataset)
            try:
                for chunk in iterator:  # mp_prefetch keeps the chunk order: the cache does not depend on num_workers
                    writer.append(chunk)
            finally:
                if hasattr(iterator, "close"):
                    iterator.close()
            writer.finish(record)
        return cls(directory)

    @classmethod
    def write(cls, directory: str, *, inputs: np.ndarray, inputs_lengths: np.ndarray, targets: np.ndarray,
              targets_lengths: np.ndarray, record: dict | None = None) -> "TokenCache":
        """Write flat token arrays and per-pair lengths as a cache (one chunk of CacheWriter)."""
        with files.naming(directory), CacheWriter(directory) as writer:
            writer.append({"inputs": inputs, "inputs_lengths": inputs_lengths, "targets": targets,
                           "targets_lengths": targets_lengths})
            writer.finish(record)
        return cls(directory)


class CacheWriter:
    """Writes a token cache chunk by chunk into a temporary folder renamed when complete (a crash leaves no
    half cache behind). Tokens go to raw int32 files as they come and only the per-pair lengths stay in
    memory; `finish` converts them into the npy files, once every chunk is in and so the token dtype known."""

    SIDES = (("inputs", "input_offsets"), ("targets", "target_offsets"))
    COPY_BLOCK = 1 << 24  # tokens per copy from the raw files: bounds the memory of `finish`

    def __init__(self, directory: str):
        self.directory, self.temporary = directory, f"{directory}.tmp{os.getpid()}"
        os.makedirs(self.temporary, exist_ok=True)
        self._raw = {side: open(self._raw_path(side), "wb") for side, _ in self.SIDES}
        self._lengths: dict[str, list[np.ndarray]] = {side: [np.zeros(1, np.int64)] for side, _ in self.SIDES}
        self._max = 0

    def _raw_path(self, side: str) -> str:
        return os.path.join(self.temporary, f"{side}.int32")

    def append(self, chunk: dict[str, np.ndarray]) -> None:
        for side, _ in self.SIDES:
            tokens = np.asarray(chunk[side], np.int32)
            # The file's write, not ndarray.tofile: a full disk then raises ENOSPC naming the file, where tofile
            # says only "61071 requested and 37888 written".
            self._raw[side].write(memoryview(np.ascontiguousarray(tokens)).cast("B"))
            self._lengths[side].append(np.asarray(chunk[f"{side}_lengths"], np.int64))
            self._max = max(self._max, int(tokens.max(initial=0)))

    def finish(self, record: dict | None = None) -> None:
        dtype = np.uint16 if self._max < 2**16 else np.int32  # halves the cache of a 32k vocabulary
        for side, offsets in self.SIDES:
            self._raw[side].close()
            count = os.path.getsize(self._raw_path(side)) // 4
            raw = np.memmap(self._raw_path(side), np.int32, mode="r") if count else np.zeros(0, np.int32)
            # Written block by block through the file, not into a memory map: a full disk is then an ENOSPC
            # naming the file, where a page of a map that cannot be allocated kills the process (SIGBUS).
            with open(os.path.join(self.temporary, f"{side}.npy"), "wb") as handle:
                np.lib.format.write_array_header_1_0(handle, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                              "fortran_order": False, "shape": (count,)})
                for start in range(0, count, self.COPY_BLOCK):
                    handle.write(memoryview(raw[start:start + self.COPY_BLOCK].astype(dtype)).cast("B"))
            del raw
            os.remove(self._raw_path(side))
            np.save(os.path.join(self.temporary, f"{offsets}.npy"), np.cumsum(np.concatenate(self._lengths[side])))
        if record is not None:
            with open(os.path.join(self.temporary, SOURCE_FILE), "w", encoding="utf-8") as handle:
                json.dump({**record, "pairs": int(sum(map(len, self._lengths["inputs"]))) - 1}, handle, indent=1)
        os.replace(self.temporary, self.directory)

    def __enter__(self) -> "CacheWriter":
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        failure = None
        for handle in self._raw.values():
            try:
                handle.close()
            except OSError as error:  # the buffered rest cannot be flushed (a full disk): close the others first
                failure = failure or error
        if exc_type is not None or failure is not None:  # only our own temporary folder: the caller's files stay
            shutil.rmtree(self.temporary, ignore_errors=True)
        if failure is not None and exc_type is None:
            raise failure


def cache_record(model_path: str, split: dict[str, Any]) -> dict[str, Any]:
    """What a cache is built from: its split's fingerprint and the vocabulary's digest."""
    return {"source": split, "vocabulary": fingerprint(model_path)}


def cache_directory(workdir: str, split: str, record: dict[str, Any]) -> str:
    """`workdir/tokens/<split>-<digest>`, the digest of `cache_record`: a cache is found without reading the
    split, and never read against another source or vocabulary."""
    digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(workdir, "tokens", f"{split}-{digest}")


def fetch_cache(directory: str, local: str) -> None:
    """Copy a published cache to this host's disk, renamed into place when whole."""
    if directory == local:
        return
    temporary = f"{local}.tmp{os.getpid()}"
    try:
        for name in (*CACHE_FILES, SOURCE_FILE):
            files.fetch(os.path.join(directory, name), os.path.join(temporary, name))
        os.replace(temporary, local)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def check_cache_record(directory: str, record: dict[str, Any]) -> None:
    """A cache found by name is used only if its SOURCE_FILE says it came from `record`."""
    path = os.path.join(directory, SOURCE_FILE)
    try:
        stored = json.loads(files.read_text(path))
    except (OSError, ValueError) as error:
        raise DataError(f"token cache {directory} has no readable {SOURCE_FILE} ({error}); delete that folder "
                        "to rebuild it") from error
    if {key: stored.get(key) for key in record} != record:
        built, wanted = stored.get("source") or {}, record["source"]
        changes = [f"{key} {built.get(key)!r} -> {wanted.get(key)!r}" for key in sorted({*built, *wanted})
                   if built.get(key) != wanted.get(key)]
        if stored.get("vocabulary") != record["vocabulary"]:
            changes.append("another vocabulary")
        raise DataError(f"token cache {directory} was built from another source ({'; '.join(changes)}); "
                        "delete that folder to rebuild it")
