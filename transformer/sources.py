"""Readers of parallel text: (source, target) sentence pairs from files or TFDS.

Both readers, `iter_text_pair` and `iter_tfds`, stream `(source, target)` string
pairs, with surrounding whitespace stripped and pairs dropped where either side
is empty (an empty side carries nothing to learn from, and would break
length-based filtering downstream), so that a multi-million-pair training split
never has to be held in Python objects at once; `file_fingerprint` and `tfds_fingerprint` identify a
source without reading its examples (the token cache is found by them). Bad input raises `DataError`, whose message names the
file, line, dataset, split, key or value at fault, so that a user can fix the
data without reading a traceback.

`tensorflow_datasets` is imported lazily inside `iter_tfds`: it takes about a
second to import, and most users of this module (tests, text corpora) never
need it.
"""

from __future__ import annotations

import contextlib
import difflib
import gzip
import itertools
import os
from collections.abc import Iterator
from typing import Any

from etils import epath

from transformer import files
from transformer.console import log
from transformer.errors import DataError

# Examples are fetched from a TFDS data source in batches of this many keys:
# ArrayRecord reads a batch in parallel, which is much faster than one key at a
# time on multi-million-example splits such as WMT14 train (see _iter_examples).
_TFDS_READ_BATCH_SIZE = 16384

# Hint appended to "dataset not prepared" errors.
_PREPARE_HINT = (
    "Prepare it first with scripts/prepare_wmt.py, or with `tfds build {name}"
    " --data_dir={data_dir} --file_format=array_record` (the random-access "
    "reader needs the array_record format)."
)


# --------------------------------------------------------------------------
# Line-aligned text files.
# --------------------------------------------------------------------------


def iter_text_pair(
    source_path: str | os.PathLike[str], target_path: str | os.PathLike[str]
) -> Iterator[tuple[str, str]]:
    """Reads a parallel corpus from two line-aligned text files, streamed in
    constant memory (an error in a late line is raised when it is reached).

    Each file holds one sentence per line, encoded as UTF-8 (a leading byte
    order mark is ignored); a path ending in `.gz` is read as gzip. Line `i` of
    the source file translates to line `i` of the target file. Each line is
    stripped of its newline and surrounding whitespace; pairs where either side
    is then empty are skipped. Yields the (source, target) pairs in file order.

    Raises:
      DataError: a file is missing or unreadable (a directory, no permission,
        a corrupt gzip stream); a line is not valid UTF-8 (the message names
        the file and 1-based line number); the files have different numbers of
        lines (the message gives both paths and counts); or no pair has text on
        both sides.
    """
    source_path, target_path = os.fspath(source_path), os.fspath(target_path)
    with contextlib.ExitStack() as open_files:
        # Open both files before reading either, so that a missing or
        # unreadable file is reported before any content error.
        source_file = open_files.enter_context(_open_binary(source_path))
        target_file = open_files.enter_context(_open_binary(target_path))
        source_lines = decode_lines(source_path, source_file)
        target_lines = decode_lines(target_path, target_file)
        yield from _align_lines(source_path, source_lines, target_path, target_lines)


def _align_lines(
    source_path: str,
    source_lines: Iterator[str],
    target_path: str,
    target_lines: Iterator[str],
) -> Iterator[tuple[str, str]]:
    """Pairs up the lines of two files, checking counts and skipping empty pairs."""
    num_pairs = 0
    num_lines = 0
    num_skipped = 0
    # zip_longest rather than zip: a shorter file must not silently truncate
    # the corpus. Both files are streamed, so counting the rest of the longer
    # one costs nothing extra.
    for source, target in itertools.zip_longest(source_lines, target_lines):
        if source is None or target is None:
            source_count = num_lines + (source is not None) + sum(1 for _ in source_lines)
            target_count = num_lines + (target is not None) + sum(1 for _ in target_lines)
            raise DataError(
                "parallel files have different numbers of lines: "
                f"{source_count} lines in {source_path!r} but "
                f"{target_count} lines in {target_path!r}"
            )
        num_lines += 1
        if source and target:
            num_pairs += 1
            yield source, target
        else:
            num_skipped += 1

    if not num_pairs:
        detail = (
            "both files are empty"
            if num_lines == 0
            else f"all {num_lines} lines are empty on at least one side"
        )
        raise DataError(f"empty parallel corpus {source_path!r} / {target_path!r}: {detail}")
    if num_skipped:
        log.info(
            "Skipped %d of %d line pairs of %r / %r with an empty side.",
            num_skipped,
            num_lines,
            source_path,
            target_path,
        )


def file_fingerprint(path: str) -> dict[str, Any]:
    """What identifies a data file without reading it: its real path, size and
    modification time (any edit, copy or `touch` changes one of them)."""
    try:
        if not files.is_local(path):  # object storage: the stat has whole seconds
            stat = epath.Path(path).stat()
            return {"path": path, "size": stat.length, "mtime_ns": int(stat.mtime or 0) * 10**9}
        stat = os.stat(path)
    except FileNotFoundError as error:
        raise DataError(f"file not found: {path!r}") from error
    except OSError as error:
        raise DataError(f"cannot read {path!r}: {error}") from error
    return {"path": os.path.realpath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _open_binary(path: str) -> Any:
    """Opens a file for reading bytes, through gzip if its name ends in `.gz`.

    Binary on purpose: iterating a binary file splits on b"\\n" only, whereas
    text mode and str.splitlines also split on U+2028, U+0085 and other Unicode
    line breaks, which do occur inside sentences of web-crawled corpora and
    would silently misalign the two sides.
    """
    try:
        if files.is_local(path):
            return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
        handle = files.open_file(path, "rb")
        return _GzipClosing(fileobj=handle, mode="rb") if path.endswith(".gz") else handle
    except FileNotFoundError as error:
        raise DataError(f"file not found: {path!r}") from error
    except IsADirectoryError as error:
        raise DataError(f"cannot read {path!r}: it is a directory, not a file") from error
    except PermissionError as error:
        raise DataError(f"cannot read {path!r}: permission denied") from error
    except OSError as error:
        raise DataError(f"cannot read {path!r}: {error}") from error


class _GzipClosing(gzip.GzipFile):
    """A GzipFile over an object-storage stream that closes the stream too (GzipFile leaves a given one open)."""

    def close(self) -> None:
        stream = self.fileobj
        try:
            super().close()
        finally:
            if stream is not None:
                stream.close()


def decode_lines(path: str, file: Any, replaced: list[int] | None = None) -> Iterator[str]:
    """Yields the decoded, stripped lines of an open binary `file` at `path`: the one reading of text that
    training, eval.py and translate share (a byte order mark, CR and surrounding whitespace dropped; lines split
    at newlines only; empty lines kept).

    Every decoding and I/O failure becomes a DataError naming the file (and
    the 1-based line number for invalid UTF-8); with `replaced` (a stream, where
    stopping would lose the lines before), invalid bytes become U+FFFD instead
    and the line numbers are appended to it.
    """
    line_number = 0
    try:
        for line_number, raw_line in enumerate(file, start=1):
            # "utf-8-sig" on the first line drops a byte order mark, which
            # str.strip() would keep (U+FEFF is not whitespace).
            encoding = "utf-8-sig" if line_number == 1 else "utf-8"
            try:
                line = raw_line.decode(encoding)
            except UnicodeDecodeError as error:
                if replaced is not None:
                    replaced.append(line_number)
                    yield raw_line.decode(encoding, errors="replace").strip()
                    continue
                raise DataError(
                    f"{path}:{line_number}: invalid UTF-8 ({error.reason} at byte "
                    f"{error.start} of the line: {raw_line[error.start:error.start + 8]!r})"
                ) from error
            yield line.strip()
    except (OSError, EOFError) as error:
        # gzip.BadGzipFile (an OSError) for a non-gzip file named *.gz,
        # EOFError for a truncated gzip stream, OSError for I/O failures.
        raise DataError(f"cannot read {path!r} after line {line_number}: {error}") from error


# --------------------------------------------------------------------------
# TensorFlow Datasets.
# --------------------------------------------------------------------------


def iter_tfds(
    name: str,
    split: str,
    *,
    source_lang: str,
    target_lang: str,
    data_dir: str | None = None,
) -> Iterator[tuple[str, str]]:
    """Reads a prepared TFDS translation dataset as (source, target) pairs, streamed in dataset order (the
    dataset is opened at the first `next`).

    `name` has its config, e.g. 'wmt14_translate/de-en' (a version, ':1.0.0', may follow); `split` is any TFDS
    split string ('train', 'validation', 'train[:1000]'); `data_dir` None means TFDS's default ($TFDS_DATA_DIR or
    ~/tensorflow_datasets). The dataset is opened with `tfds.data_source(...)`, TFDS's random-access ArrayRecord
    reader, which works without TensorFlow. It is never downloaded or generated here (`download=False`):
    preparing WMT takes hours and needs the network (scripts/prepare_wmt.py). Each example is a dict keyed by
    language code; the values are bytes for real data (decoded as UTF-8) and str under `tfds.testing.mock_data`.
    As in `iter_text_pair`, values are stripped and pairs with an empty side are skipped.

    Raises DataError: unknown dataset name (with close registered names); dataset not prepared in `data_dir`;
    unknown config or split, or data without random access; a language not among the example's keys; a value
    that is not valid UTF-8; or no pair with text on both sides. The TFDS exception is kept as `__cause__`.
    """
    data_source = _open_data_source(name, split, data_dir)
    where = f"TFDS dataset {name!r} split {split!r}"
    num_pairs = 0
    num_examples = 0
    num_skipped = 0
    for index, example in enumerate(_iter_examples(data_source)):
        num_examples += 1
        if source_lang not in example or target_lang not in example:
            missing = [lang for lang in (source_lang, target_lang) if lang not in example]
            raise DataError(
                f"{where}: no language {', '.join(map(repr, missing))} in example {index}; "
                f"its keys are {sorted(example)}"
            )
        source = _decode_value(example[source_lang], where, index, source_lang)
        target = _decode_value(example[target_lang], where, index, target_lang)
        if source and target:
            num_pairs += 1
            yield source, target
        else:
            num_skipped += 1

    if not num_pairs:
        detail = (
            "it has no examples"
            if num_examples == 0
            else f"all {num_examples} examples are empty on at least one side"
        )
        raise DataError(f"{where} is empty: {detail}")
    if num_skipped:
        log.info(
            "Skipped %d of %d examples of %s with an empty side.", num_skipped, num_examples, where
        )


def _open_data_source(name: str, split: str, data_dir: str | None) -> Any:
    """`tfds.data_source` of a prepared dataset, its failures as DataError."""
    tfds = _import_tfds()
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except tfds.core.DatasetNotFoundError as error:
        # Trust TFDS's own lookup rather than pre-checking list_builders():
        # TFDS also opens unregistered datasets that are prepared in data_dir
        # (read-only builders from dataset_info.json), which a registry check
        # would wrongly reject.
        raise DataError(_unknown_dataset_message(tfds, name, data_dir)) from error
    except Exception as error:  # pylint: disable=broad-except
        # TFDS signals an unprepared or unreadable dataset with assorted types:
        # KeyError ("splits is empty") when data_dir is None, NotImplementedError
        # ("file format TFRECORD not supported") when it is given, ValueError
        # for an unknown config or split, AssertionError for an unknown
        # version. Diagnose which case it is and say so.
        raise _open_error(tfds, name, split, data_dir, error) from error


def tfds_fingerprint(name: str, split: str, data_dir: str | None = None) -> dict[str, Any]:
    """What identifies a prepared TFDS split without reading its examples: the
    dataset's full name (with the resolved version), where it is prepared, the
    split string, and the size and modification time of its dataset_info.json
    (rewritten whenever the dataset is prepared again)."""
    data_source = _open_data_source(name, split, data_dir)  # an unprepared or unknown one fails here
    tfds = _import_tfds()
    builder = tfds.builder(name, data_dir=data_dir)
    info_path = os.path.join(os.fspath(builder.data_dir), "dataset_info.json")
    info = file_fingerprint(info_path) if files.exists(info_path) else None
    return {"name": builder.info.full_name, "data_dir": os.fspath(builder.data_dir), "split": split,
            "examples": len(data_source), "dataset_info": info}


def _import_tfds() -> Any:
    """Imports tensorflow_datasets with its translation builders registered.

    Behaviour of tensorflow-datasets 4.9.10 without TensorFlow installed:

    * `import tensorflow_datasets` succeeds, but imports its dataset families
      (`tensorflow_datasets.translate`, ...) through `etils.epy.lazy_imports`,
      i.e. only on first attribute access. So the legacy WMT builders
      (wmt13_translate ... wmt19_translate, wmt_t2t_translate, wmt_translate),
      which live only in `tensorflow_datasets/translate/`, are NOT registered:
      `tfds.builder('wmt14_translate')` raises DatasetNotFoundError. (opus,
      para_crawl, ted_* are registered, because they moved to the directory-
      scanned `tensorflow_datasets/datasets/`.)
    * `import tensorflow_datasets.translate` works without TensorFlow (~15 ms)
      and registers all of them: its `__init__` imports every translate module.
      Importing one module, e.g. `tensorflow_datasets.translate.wmt14`, runs
      that same package `__init__` first, so it registers exactly the same set;
      importing the package is therefore enough, and a per-prefix fallback
      could not succeed where the package import failed.
    * `tfds.list_builders()` (with its default with_community_datasets=True)
      tries to read the community index from GCS and fails without gcsfs and
      network; `with_community_datasets=False` is local and fast.
    """
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    try:
        import tensorflow_datasets.translate  # pylint: disable=g-import-not-at-top,unused-import
    except Exception as error:  # pylint: disable=broad-except
        # Not fatal: non-WMT datasets still work; a WMT name will then fail
        # with the unknown-dataset error, and this warning explains why.
        log.warning(
            "Could not import tensorflow_datasets.translate (%s); the WMT datasets "
            "will not be registered.",
            error,
        )
    return tfds


def _base_name(name: str) -> str:
    """'wmt14_translate/de-en:1.0.0' -> 'wmt14_translate'."""
    return name.split("/", 1)[0].split(":", 1)[0]


def _unknown_dataset_message(tfds: Any, name: str, data_dir: str | None) -> str:
    """The DataError message for a name that TFDS does not know."""
    base_name = _base_name(name)
    message = (
        f"unknown TFDS dataset {base_name!r} (from {name!r}): it is not a registered "
        f"builder, nor prepared in data_dir {data_dir or _default_data_dir(tfds)!r}"
    )
    try:
        registered = tfds.list_builders(with_community_datasets=False)
    except Exception:  # pylint: disable=broad-except
        registered = []  # Suggestions are a nicety; never mask the real error.
    suggestions = difflib.get_close_matches(base_name, registered, n=5)
    if suggestions:
        message += f"; did you mean {', '.join(map(repr, suggestions))}?"
    return message


def _open_error(
    tfds: Any, name: str, split: str, data_dir: str | None, error: Exception
) -> DataError:
    """Explains why `tfds.data_source` failed for a known dataset name."""
    shown_data_dir = data_dir or _default_data_dir(tfds)
    try:
        # Constructing a builder neither downloads nor writes anything; it reads
        # dataset_info.json from data_dir if the dataset is prepared there.
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception:  # pylint: disable=broad-except
        # Unknown config or version: TFDS's message says which, but (in 4.9.10)
        # its list of close configs comes out empty, so list them here.
        message = f"cannot open TFDS dataset {name!r}: {error}"
        configs = _available_configs(tfds, name)
        if configs:
            message += f" (available configs: {', '.join(configs)})"
        return DataError(message)
    if not builder.is_prepared():
        return DataError(
            f"TFDS dataset {name!r} is not prepared in data_dir {shown_data_dir!r} "
            f"(nothing at {os.fspath(builder.data_dir)!r}). "
            + _PREPARE_HINT.format(name=name.split(":", 1)[0], data_dir=shown_data_dir)
        )
    # Prepared, yet unreadable: an unknown split, or prepared in a format
    # without random access (tfrecord); TFDS's message says which.
    return DataError(
        f"cannot read split {split!r} of TFDS dataset {name!r} from "
        f"{os.fspath(builder.data_dir)!r}: {error}"
    )


def _available_configs(tfds: Any, name: str) -> list[str]:
    """The config names of the builder named in `name`, or [] if unknown."""
    try:
        return sorted(tfds.builder_cls(_base_name(name)).builder_configs)
    except Exception:  # pylint: disable=broad-except
        return []  # A nicety for the error message; never mask the real error.


def _default_data_dir(tfds: Any) -> str:
    """TFDS's default data directory, for error messages."""
    return os.fspath(getattr(tfds.core.constants, "DATA_DIR", "~/tensorflow_datasets"))


def _iter_examples(data_source: Any) -> Iterator[dict[str, Any]]:
    """Yields all examples of a TFDS data source, fetched in batches.

    Batches through `__getitems__` because one key at a time is an order of
    magnitude slower: over an hour instead of minutes for WMT14 train.
    """
    size = len(data_source)
    for start in range(0, size, _TFDS_READ_BATCH_SIZE):
        keys = list(range(start, min(start + _TFDS_READ_BATCH_SIZE, size)))
        try:
            batch = data_source.__getitems__(keys)
        except TypeError:
            # `tfds.testing.mock_data` (4.9.10) installs its fake __getitems__
            # on a MagicMock as a plain attribute, so it is called without
            # `self` and raises TypeError; its __getitem__ works. A genuine
            # TypeError would resurface from __getitem__ below.
            batch = [data_source[key] for key in keys]
        yield from batch


def _decode_value(value: Any, where: str, index: int, lang: str) -> str:
    """Returns one side of a TFDS example as a stripped str."""
    if isinstance(value, bytes):  # Real data (also numpy.bytes_, a subclass).
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as error:
            raise DataError(
                f"{where}: example {index}, language {lang!r}: invalid UTF-8 "
                f"({error.reason} at byte {error.start}: {value[:60]!r})"
            ) from error
    elif not isinstance(value, str):  # mock_data gives str (or numpy.str_).
        raise DataError(
            f"{where}: example {index}, language {lang!r}: expected text, got "
            f"{type(value).__name__} {value!r:.60}"
        )
    return str(value).strip()
