"""The one path layer: every file a run reads or writes goes through these functions, which take local paths
and URLs (`gs://bucket/run`, any scheme `etils.epath` knows, as Orbax and TFDS use) alike.

Writes are atomic: on a local disk a temporary file beside the target, fsynced and renamed over it, so a
kill leaves the old file or the new one, never part of one; on object storage one upload, which lands whole
or not at all. What must sit on a local disk (memory-mapped token caches, the sentencepiece model its C++
library opens, files appended to) is kept in `local_directory` and copied to the workdir (`publish`) or
from it (`fetch`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from typing import Any

from etils import epath

from transformer.console import log
from transformer.errors import ReportedError



class StorageError(ReportedError, OSError):
    """A path whose storage cannot be reached or written from here: a URL scheme with no filesystem installed, a
    read-only folder the command must write."""


# The extra that installs each scheme's filesystem (pyproject.toml).
SCHEME_EXTRAS = {"gs": "gcs"}


def check_storage(path: str, flag: str) -> None:
    """Raise StorageError, naming `flag` and the fix, when `path` is a URL whose scheme has no filesystem here
    (fsspec's ImportError would otherwise surface from deep inside the first read, as a long traceback)."""
    scheme, separator, _ = path.partition("://")
    if not separator:
        return
    try:
        epath.Path(path).exists()
    except ImportError as error:
        fix = (f'pip install -e ".[{SCHEME_EXTRAS[scheme]}]"' if scheme in SCHEME_EXTRAS else
               f"install a filesystem for {scheme}:// (fsspec's) or use a local path")
        raise StorageError(f"{flag}={path}: {scheme}:// cannot be read here ({error}); {fix}") from None
    except (ValueError, KeyError) as error:  # a scheme epath or fsspec does not know at all
        raise StorageError(f"{flag}={path}: unknown scheme {scheme}:// ({error})") from None


def check_writable(path: str, flag: str, writes: str) -> None:
    """Raise StorageError, naming `flag`, when the local folder `path` (or, before it exists, the nearest folder
    above it) cannot be written: checked before any work, where the first write would fail only after it.
    `writes` says what the command keeps there. Object storage is not probed: its errors come from the write."""
    if not is_local(path):
        return
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if os.access(existing, os.W_OK | os.X_OK):
        return
    reason = "read-only file system" if os.statvfs(existing).f_flag & os.ST_RDONLY else "permission denied"
    raise StorageError(f"{flag}={path}: {existing} cannot be written ({reason}); {writes}")



@contextlib.contextmanager
def naming(path: str):
    """Inside, an OSError that names no file (a buffered write's ENOSPC: `[Errno 28] No space left on device`)
    is raised again naming `path`, the file or folder being written, so that its message says which disk."""
    try:
        yield
    except OSError as error:
        if error.filename is None and error.errno:
            raise type(error)(error.errno, error.strerror, path) from error
        raise


class DamagedFileError(ReportedError, ValueError):
    """A file exists but cannot be read as what it should be."""


_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_local(path: str | os.PathLike) -> bool:
    """Whether `path` names a local file (no URL scheme such as gs://)."""
    return not _SCHEME.match(os.fspath(path))


def absolute(path: str) -> str:
    """An absolute local path, or the URL unchanged (os.path.abspath would turn gs://b into $PWD/gs:/b)."""
    return os.path.abspath(path) if is_local(path) else os.fspath(path)


def exists(path: str) -> bool:
    return epath.Path(path).exists()


def is_dir(path: str) -> bool:
    return epath.Path(path).is_dir()


def list_dir(path: str) -> list[str]:
    """The names in directory `path`, [] when there is none."""
    directory = epath.Path(path)
    return sorted(child.name for child in directory.iterdir()) if directory.is_dir() else []


def make_dirs(path: str) -> None:
    epath.Path(path).mkdir(parents=True, exist_ok=True)


def read_bytes(path: str) -> bytes:
    return epath.Path(path).read_bytes()


def read_text(path: str) -> str:
    return epath.Path(path).read_text(encoding="utf-8")


def open_file(path: str, mode: str = "r"):
    """A file object for a local path or a URL (text modes read and write UTF-8)."""
    if is_local(path):
        return open(path, mode, **({} if "b" in mode else {"encoding": "utf-8"}))
    return epath.Path(path).open(mode)


def cache_root() -> str:
    """The project's cache on this machine: $TRANSFORMER_CACHE_DIR (the tests set it to their session's directory),
    else the user's XDG cache."""
    return os.environ.get("TRANSFORMER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "transformer")


def local_directory(workdir: str, root: str = "") -> str:
    """Where the workdir's local files live: the workdir itself when it is local, else a mirror of its URL under
    `root` (default $TRANSFORMER_CACHE_DIR/workdirs or ~/.cache/transformer/workdirs)."""
    if is_local(workdir):
        return workdir
    root = root or os.path.join(cache_root(), "workdirs")
    scheme, rest = os.fspath(workdir).split("://", 1)
    return os.path.join(root, scheme, rest.strip("/"))


def publish(local_path: str, path: str) -> None:
    """Copy a local file to `path` (nothing to do when they are the same file), streamed: a token cache can
    be gigabytes. On object storage the upload lands whole or not at all."""
    if os.fspath(local_path) == os.fspath(path):
        return
    if is_local(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        temporary = temporary_path(path)
        shutil.copyfile(local_path, temporary)
        os.replace(temporary, path)
        return
    with open(local_path, "rb") as source, epath.Path(path).open("wb") as destination:
        shutil.copyfileobj(source, destination, 1 << 24)


def fetch(path: str, local_path: str) -> None:
    """Copy `path` (a local path or a URL) to a local file, whole or not at all."""
    if os.fspath(local_path) == os.fspath(path):
        return
    os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
    temporary = temporary_path(local_path)
    try:
        with open_file(path, "rb") as source, open(temporary, "wb") as destination:
            shutil.copyfileobj(source, destination, 1 << 24)
        os.replace(temporary, local_path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def temporary_path(path: str) -> str:
    directory, name = os.path.split(absolute(path))
    return os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.tmp")


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_directory(directory: str) -> None:
    """Makes a rename durable across a power loss; some filesystems cannot open or fsync a directory."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_bytes(path: str, data: bytes) -> None:
    """Replace `path` with `data` atomically: a temporary file beside it, fsynced, then renamed over it; on
    object storage, one upload."""
    if not is_local(path):
        epath.Path(path).write_bytes(data)
        return
    temporary = temporary_path(path)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _fsync_directory(os.path.dirname(os.path.abspath(path)))


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str, obj: Any, *, indent: int | None = 2) -> None:
    write_text(path, json.dumps(obj, indent=indent) + "\n")


def copy_file(source: str, destination: str) -> None:
    """Copy `source` to `destination` atomically (for small files: read whole)."""
    write_bytes(destination, read_bytes(source))


_ABSENT = object()


def read_json(path: str, default: Any = _ABSENT, *, cache: bool = False) -> Any:
    """The JSON value in `path`, or `default` (an empty dict unless given) when there is no such file.

    A file that exists but is not valid JSON raises WorkdirFileError naming it: a record (run.json,
    reports.json) must not be silently replaced by an empty one. With cache=True (a file that can be
    recomputed) it is only warned about and `default` returned."""
    default = {} if default is _ABSENT else default
    try:
        return json.loads(read_text(path))
    except FileNotFoundError:
        return default
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        message = f"{path} is not valid JSON ({error})"
        if cache:
            log.warning("%s; ignoring it", message)
            return default
        raise DamagedFileError(f"{message}: the file is damaged; repair it, or move it aside to start it anew") \
            from error
