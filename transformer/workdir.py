"""The workdir: one owner at a time, files that a kill cannot tear, the identity of its vocabulary, and the names
and records of what a run keeps there (config.json, run.json with each start's provenance, reports.json).

**One owner.** A training job holds `workdir/lock.json` (host, pid, when it started, a heartbeat) from start to
end; a second job on the same workdir is refused at once with `WorkdirInUseError`, naming the holder. In a
multi-host job only process 0 takes the lock: the job's processes are one owner.

The lock is created atomically: written whole under a temporary name, then hard-linked to `lock.json`, which
fails if `lock.json` exists (the classic way that is atomic on local disks and on NFS, where O_EXCL once was
not; on a filesystem without hard links, O_CREAT | O_EXCL instead). The holder's daemon thread rewrites the
heartbeat every `heartbeat_seconds` (60 s) through its own open file, so a refresh can never overwrite a
lock that another job has since taken over.

**Staleness rule.** A lock is stale, and taken over with a one-line warning naming the old holder, when
- it was written on this machine (same host name, boot and pid namespace) and its pid is no longer running,
  or is running but is another process (its start time differs: the pid was reused); or
- its heartbeat is older than `stale_after_seconds` (10 minutes: ten missed refreshes), wherever it was
  written. Pids of other hosts cannot be checked, so a job whose host died is taken over only after that;
  the heartbeat is compared with this host's clock, so clocks must agree to well within that threshold.
A lock that cannot be parsed is judged by its file's modification time under the second rule.

Taking over is race-free: a taker first creates the claim file `lock.json.<holder's token>.claim`
exclusively, so of several starters finding the same stale lock only one removes it, and only if it is still
that lock; a release goes through the same claim, so it removes the lock only if it is still its own.

On object storage mounted as a filesystem (gcsfuse, s3fs, ...) there are neither hard links nor an atomic
O_EXCL, and the same rule applies with the heartbeat time only. What holds there: a job that starts while
another's lock is visible is refused, and a dead job's lock is taken over once its heartbeat is older than
the threshold. What does not: two jobs starting within the same few seconds may both get the lock, and a
takeover or a refresh racing another job's is not guarded.

**Files** go through transformer/files.py, which takes local paths and URLs (gs://) alike. On object storage
the lock is written whole and read back: a job that starts while another's lock is visible is refused, but
two jobs starting within the same second may both see their own lock (object stores have no exclusive
create here).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import hashlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

import jax
import numpy as np
from etils import epath

from transformer import files
from transformer.console import log
from transformer.errors import DataError, ReportedError
from transformer.files import temporary_path, write_all, exists, is_local, make_dirs, open_file, read_bytes, write_bytes

LOCK_FILE = "lock.json"
VOCABULARY_FILE = "vocab.model"
CONFIG_FILE = "config.json"  # the run's whole config, with the vocabulary size its model has
RUN_FILE = "run.json"  # the batch shape a run trains on, and each start's provenance
REPORTS_FILE = "reports.json"  # the train.report_minutes scores, by mark, written at each mark
CHECKPOINTS_DIR = "checkpoints"  # the train states
PARAMS_DIR = "params"  # params snapshots of the last decode.average_last checkpoints, for averaging
BEST_CHECKPOINT_DIR = "best_checkpoint"  # the params of the best dev BLEU (train.keep_best_checkpoint)



class WorkdirInUseError(ReportedError, RuntimeError):
    """Another live job holds the workdir. A RuntimeError, not a ValueError: no argument is wrong, the same
    command succeeds once that job ends, and it must not be mistaken for a config error."""


class WorkdirLockLost(ReportedError, RuntimeError):
    """This job's workdir lock was taken over (judged stale) by another job."""


class VocabularyMismatchError(DataError):
    """The vocabulary file is not the one the workdir's run was trained with."""


# ----------------------------------------------------------------------------------------------------
# The vocabulary's identity


def fingerprint(path: str) -> str:
    """The sha256 hex digest of the file's bytes."""
    digest = hashlib.sha256()
    with open_file(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def vocabulary_record(path: str, vocab_size: int) -> dict[str, Any]:
    """What run.json keeps of the vocabulary a run trains with."""
    return {"file": os.path.basename(path), "sha256": fingerprint(path), "pieces": int(vocab_size)}


def check_vocabulary(recorded: dict[str, Any] | None, path: str) -> None:
    """Refuse `path` unless it is the recorded vocabulary (`vocabulary_record`); with none recorded yet (None: a
    first start) it passes."""
    if not recorded:
        return
    found = fingerprint(path)
    if found != recorded.get("sha256"):
        raise VocabularyMismatchError(
            f"{path} (sha256 {found}) is not the vocabulary this run was trained with ({recorded.get('file')}, "
            f"sha256 {recorded.get('sha256')}, {recorded.get('pieces')} pieces); put that file back, or use a new "
            "--workdir")


# ----------------------------------------------------------------------------------------------------
# One owner per workdir


def _now_text(seconds: float | None = None) -> str:
    """UTC with milliseconds: a fixed width, so a heartbeat rewrite never changes the lock file's length."""
    moment = datetime.datetime.fromtimestamp(time.time() if seconds is None else seconds, datetime.timezone.utc)
    return moment.isoformat(timespec="milliseconds")


def _seconds_of(text: Any) -> float | None:
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except (TypeError, ValueError):
        return None


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{max(seconds, 0):.0f}s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _read_first_line(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.readline().strip() or None
    except OSError:
        return None


def this_machine() -> dict[str, Any]:
    """What makes a pid meaningful: the host name, this boot of it, and the pid namespace (containers on one
    host share its name and boot but not their pids)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = None
    return {"host": socket.gethostname(), "boot_id": _read_first_line("/proc/sys/kernel/random/boot_id"),
            "pid_namespace": namespace}


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) from /proc, or None where there is no /proc entry."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            fields = handle.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
    except OSError:
        return None
    return fields[0], fields[19]


def process_start(pid: int) -> str | None:
    """A token that differs between two processes that had the same pid, where the system tells it cheaply."""
    stat = _proc_stat(pid)
    return stat[1] if stat else None


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this machine (a zombie, killed but not yet reaped, does not)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    stat = _proc_stat(pid)
    return stat is None or stat[0] != "Z"


def stale_reason(holder: dict[str, Any] | None, *, modified: float, now: float, stale_after_seconds: float,
                 machine: dict[str, Any]) -> str | None:
    """Why a lock is stale under the module's rule, or None while its holder may be alive. `holder` is the
    lock's record (None: unreadable), `modified` its file's modification time."""
    if holder is None:
        age = now - modified
        return f"it is unreadable and was last modified {_ago(age)} ago" if age > stale_after_seconds else None
    pid = holder.get("pid")
    if all(holder.get(key) == value for key, value in machine.items()):
        if not pid_alive(pid):
            return f"pid {pid} is no longer running on this host"
        started = holder.get("process_start")
        if started and process_start(pid) not in (None, started):
            return f"pid {pid} on this host is now another process"
    heartbeat = _seconds_of(holder.get("heartbeat"))
    age = now - (modified if heartbeat is None else heartbeat)
    if age > stale_after_seconds:
        return f"its last heartbeat was {_ago(age)} ago, over the {_ago(stale_after_seconds)} allowed"
    return None


def describe(holder: dict[str, Any] | None, now: float | None = None) -> str:
    """'pid 123 on host-a (started ..., last heartbeat 12s ago)' for messages."""
    if holder is None:
        return "an unknown holder (the lock is unreadable)"
    heartbeat = _seconds_of(holder.get("heartbeat"))
    beat = f", last heartbeat {_ago((now or time.time()) - heartbeat)} ago" if heartbeat is not None else ""
    return f"pid {holder.get('pid')} on {holder.get('host')} (started {holder.get('started')}{beat})"


_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


REMOTE = -1  # create_exclusive's "created" on object storage, where there is no descriptor to keep


def create_exclusive(path: str, data: bytes, settle_seconds: float = 1.0) -> int | None:
    """Create `path` holding `data` only if it does not exist; returns a read-write descriptor of the new file,
    or None when `path` already exists. The file appears whole (hard link of a complete temporary file). On
    object storage (REMOTE when created): written whole if absent, then read back after `settle_seconds`, so
    that of two writers racing, the one whose object was replaced learns it."""
    if not is_local(path):
        if exists(path):
            return None
        write_bytes(path, data)
        time.sleep(settle_seconds)
        try:
            return REMOTE if read_bytes(path) == data else None
        except FileNotFoundError:
            return None
    temporary = temporary_path(path)
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
        try:
            os.link(temporary, path)
            created = True
        except FileExistsError:
            created = os.fstat(fd).st_nlink == 2  # NFS: a retried link whose first attempt had succeeded
        except OSError as error:
            if error.errno not in _NO_HARD_LINKS:
                raise
            created = None
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    if created:
        return fd
    os.close(fd)
    if created is None:  # no hard links here: O_EXCL, where the file is briefly empty (readers retry)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return None
        write_all(fd, data)
        os.fsync(fd)
        return fd
    return None


def read_lock(path: str, attempts: int = 4) -> tuple[dict[str, Any] | None, str, float] | None:
    """(record or None if unreadable, identity, modification time) of the lock at `path`, or None if there is
    none. The identity is the holder's token, or for an unreadable lock a digest of its bytes. A lock being
    created or refreshed can be caught mid-write, so an unparsable one is read again a few times."""
    for attempt in range(attempts):
        try:
            if is_local(path):
                with open(path, "rb") as handle:
                    raw = handle.read()
                    modified = os.fstat(handle.fileno()).st_mtime
            else:
                raw, modified = read_bytes(path), float(epath.Path(path).stat().mtime or 0)
        except FileNotFoundError:
            return None
        try:
            record = json.loads(raw)
            if isinstance(record, dict) and isinstance(record.get("token"), str):
                return record, record["token"], modified
        except ValueError:
            pass
        if attempt < attempts - 1:
            time.sleep(0.05)
    return None, "unreadable-" + hashlib.sha256(raw).hexdigest()[:16], modified


class WorkdirLock:
    """`workdir/lock.json`, held from acquire() to release() (or as a context manager); see the module's
    docstring for the staleness rule. One object per owning process; acquire() raises WorkdirInUseError
    while another live job holds it."""

    def __init__(self, workdir: str, *, heartbeat_seconds: float = 60.0, stale_after_seconds: float = 600.0,
                 takeover_timeout_seconds: float = 10.0):
        if heartbeat_seconds <= 0 or stale_after_seconds < 3 * heartbeat_seconds:
            raise ValueError(f"stale_after_seconds={stale_after_seconds} must be at least 3 heartbeats of "
                             f"heartbeat_seconds={heartbeat_seconds}, so that a live holder is never judged stale")
        self.workdir, self.path = workdir, os.path.join(workdir, LOCK_FILE)
        self.local = is_local(workdir)
        self.heartbeat_seconds, self.stale_after_seconds = heartbeat_seconds, stale_after_seconds
        self.takeover_timeout_seconds = takeover_timeout_seconds
        self.record: dict[str, Any] | None = None  # ours while held
        self.lost: str | None = None  # why we no longer hold it, once the heartbeat finds it taken over
        self._fd: int | None = None
        self._pid: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None and self.lost is None

    def _new_record(self) -> dict[str, Any]:
        now = _now_text()
        return {"host": socket.gethostname(), "pid": os.getpid(), "started": now, "command": " ".join(sys.argv)[:500],
                "token": uuid.uuid4().hex, **{k: v for k, v in this_machine().items() if k != "host"},
                "process_start": process_start(os.getpid()), "heartbeat": now}

    def acquire(self, wait_seconds: float = 0.0) -> "WorkdirLock":
        """Take the lock, or raise WorkdirInUseError at once while a live job holds it; with wait_seconds, wait
        up to that long first for it to be released or to go stale (e.g. a job requeued on another host)."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this WorkdirLock")
        make_dirs(self.workdir)
        machine, start = this_machine(), time.monotonic()
        stuck_after = start + self.takeover_timeout_seconds
        while True:
            status, detail = self._attempt(machine)
            now = time.monotonic()
            if status == "acquired":
                return self
            if status == "in use":
                if now - start >= wait_seconds:
                    raise WorkdirInUseError(self._in_use_message(detail, time.time()))
                stuck_after = now + self.takeover_timeout_seconds  # waiting for a live holder is not a stuck takeover
                time.sleep(min(0.25, start + wait_seconds - now))
            elif status == "taking over" and now > stuck_after:
                raise WorkdirInUseError(
                    f"{self.path} is stale but {detail} shows a takeover that did not finish in "
                    f"{self.takeover_timeout_seconds:.0f}s; if no other job is starting on {self.workdir}, "
                    f"delete {detail}")
            elif status == "taking over":
                time.sleep(0.02)  # another starter is taking it over: look again once it has

    def _attempt(self, machine: dict[str, Any]) -> tuple[str, Any]:
        """One try: ("acquired", None); ("retry", None) when the lock vanished or we removed a stale one;
        ("in use", holder record); ("taking over", claim path) while another starter takes a stale lock over."""
        record = self._new_record()
        fd = create_exclusive(self.path, _encode(record))
        if fd is not None:
            self._hold(fd, record)
            return "acquired", None
        found = read_lock(self.path)
        if found is None:
            return "retry", None  # released or taken over between our two looks
        holder, identity, modified = found
        now = time.time()
        reason = stale_reason(holder, modified=modified, now=now, stale_after_seconds=self.stale_after_seconds,
                              machine=machine)
        if reason is None:
            return "in use", holder
        claim = f"{self.path}.{identity}.claim"
        if not remove_if_unchanged(self.path, identity, claim):
            return "taking over", claim
        log.warning("took over the stale workdir lock %s of %s: %s", self.path, describe(holder, now), reason)
        return "retry", None

    def _in_use_message(self, holder: dict[str, Any] | None, now: float) -> str:
        mine = holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()
        whom = "this process (a WorkdirLock of it not released)" if mine else describe(holder, now)
        return (f"{self.workdir} is in use: {self.path} is held by {whom}. Wait for that run to end, use another "
                f"--workdir, or delete {self.path} if you know that run is dead.")

    def _hold(self, fd: int, record: dict[str, Any]) -> None:
        self._fd, self.record, self._pid, self.lost = fd, record, os.getpid(), None
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="workdir-lock-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.release)  # a run that ends without release() still frees its workdir

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                self.check()
                self.record = {**self.record, "heartbeat": _now_text()}
                data = _encode(self.record)
                if not self.local:  # checked ours just above; an object cannot be rewritten in place
                    write_bytes(self.path, data)
                    continue
                os.pwrite(self._fd, data, 0)  # our own file: a lock another job took over is another file
                if os.fstat(self._fd).st_size != len(data):
                    os.ftruncate(self._fd, len(data))
                os.fsync(self._fd)
            except WorkdirLockLost as error:
                self.lost = self.lost or f"{error}"
                log.warning("lost the workdir lock %s: %s", self.path, self.lost)
                return
            except OSError as error:  # a transient failure (NFS ESTALE, EIO): the next beat tries again
                log.warning("could not refresh the workdir lock %s: %s (trying again in %.0fs)", self.path, error,
                            self.heartbeat_seconds)

    def check(self) -> None:
        """Raise WorkdirLockLost if the lock is no longer ours (another job judged it stale and took it)."""
        if self._fd is None:
            raise WorkdirLockLost(f"{self.path} is not held by this process")
        if self.lost:
            raise WorkdirLockLost(self.lost)
        found = read_lock(self.path)
        if found is None or found[1] != self.record["token"]:
            holder = None if found is None else found[0]
            self.lost = (f"{self.path} is now held by {describe(holder)}" if found else f"{self.path} was removed")
            raise WorkdirLockLost(self.lost)

    def release(self) -> bool:
        """Stop the heartbeat and remove the lock if it is still ours; returns whether it was removed."""
        if self._fd is None or os.getpid() != self._pid:  # a forked child never frees its parent's lock
            return False
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        removed = False
        try:
            token = self.record["token"]
            removed = remove_if_unchanged(self.path, token, f"{self.path}.{token}.claim")
        finally:
            if self._fd != REMOTE:
                os.close(self._fd)
            self._fd, self._thread = None, None
            atexit.unregister(self.release)
        if not removed:
            log.warning("left %s in place: it is no longer this process's lock", self.path)
        return removed

    def __enter__(self) -> "WorkdirLock":
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()


def remove_if_unchanged(path: str, identity: str, claim: str) -> bool:
    """Remove the lock at `path` if it is still the one of `identity`. The claim file, created exclusively,
    makes this one remover's act: every removal of a lock goes through its claim, so the lock seen under the
    claim cannot be replaced before it is removed, and of two removers only the first succeeds."""
    fd = create_exclusive(claim, _encode({"host": socket.gethostname(), "pid": os.getpid(), "time": _now_text(),
                                          "token": uuid.uuid4().hex}))
    if fd is None:
        return False
    try:
        found = read_lock(path)
        if found is None or found[1] != identity:
            return False
        epath.Path(path).unlink()
        return True
    finally:
        if fd != REMOTE:
            os.close(fd)
        epath.Path(claim).unlink()


def _encode(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, indent=1) + "\n").encode("utf-8")


# ----------------------------------------------------------------------------------------------------
# What a run keeps in its workdir besides checkpoints: its config, its record (run.json), its report marks


def read_run_file(workdir: str) -> dict[str, Any]:
    return files.read_json(os.path.join(workdir, RUN_FILE), {})  # {} before the first start writes it


def provenance(batch: Any, mesh: Any, microbatches: int) -> dict[str, Any]:
    """What a researcher needs days later to know what ran: code, packages, devices, mesh, tokens per step."""
    import importlib.metadata
    import platform
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10).stdout.strip()) if commit else None
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout (an installed package)
        commit, dirty = None, None
    versions = {}
    for package in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy", "sentencepiece",
                    "sacrebleu", "tensorflow-datasets", "transformer"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"time": now, "command": sys.argv,
            "host": platform.node(), "commit": commit, "uncommitted_changes": dirty, "python": sys.version.split()[0],
            "packages": versions, "device_kind": jax.devices()[0].device_kind, "devices": jax.device_count(),
            "processes": jax.process_count(), "mesh": dict(mesh.shape), "microbatches": microbatches,
            "rows": batch.rows, "row_length": batch.row_length, "tokens_per_step": batch.tokens}


def record_start(workdir: str, batch: Any, mesh: Any, microbatches: int, vocabulary: dict[str, Any] | None = None,
                 train_data: Any = None, init_from: dict[str, Any] | None = None) -> None:
    """run.json: the batch shape (a plan.BatchShape), the vocabulary's record (`vocabulary_record`) and the train
    data's fingerprint (once: a resume keeps the data stream, and is refused another vocabulary), the run a warm
    start's parameters came from (once), and every start's provenance, written whole."""
    record = read_run_file(workdir)
    record.setdefault("batch", {"rows": batch.rows, "row_length": batch.row_length})
    if init_from is not None:
        record.setdefault("init_from", init_from)
    if vocabulary is not None:
        record.setdefault("vocabulary", vocabulary)
        record.setdefault("train_data", train_data)
    record.setdefault("starts", []).append(provenance(batch, mesh, microbatches))
    files.write_json(os.path.join(workdir, RUN_FILE), record)


def read_reports(workdir: str) -> dict[str, Any]:
    """The train.report_minutes scores an earlier part of the run wrote (workdir/reports.json), by mark."""
    return files.read_json(os.path.join(workdir, REPORTS_FILE), {})


def write_reports(workdir: str, reports: dict[str, Any]) -> None:
    if jax.process_index() == 0:
        files.write_json(os.path.join(workdir, REPORTS_FILE), reports)


def use_compilation_cache(directory: str, workdir: str) -> None:
    """JAX's persistent compilation cache, so that a restarted run loads its compiled steps instead of compiling
    them again: train.compilation_cache_dir, by default workdir/compilation_cache; "none" turns it off. A cache
    the environment already chose (JAX_COMPILATION_CACHE_DIR) is left as it is."""
    if directory == "none" or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", directory or os.path.join(workdir, "compilation_cache"))


# ----------------------------------------------------------------------------------------------------
# The lock of a multi-process job: process 0 holds it, every process learns whether it does


def acquire_workdir(workdir: str) -> WorkdirLock | None:
    """Process 0 takes the workdir's lock for the whole job (WorkdirLock); every process learns whether it did, so
    that all refuse together. A lock this process still holds from a run it never closed is released first: one
    process is one owner."""
    lock, error = None, None
    if jax.process_index() == 0:
        previous = _HELD_LOCKS.pop(_lock_key(workdir), None)
        if previous is not None:
            previous.release()
        try:
            lock = WorkdirLock(workdir).acquire()
            _HELD_LOCKS[_lock_key(workdir)] = lock
        except Exception as caught:  # in use, or an unwritable workdir: every process must learn it
            error = caught
    if not _on_every_process(error is None) and error is None:
        error = WorkdirInUseError(f"{workdir} is in use: process 0's log names the job that holds it")
    if error is not None:
        raise error
    return lock


def check_workdir_lock(lock: WorkdirLock | None) -> None:
    """Raise WorkdirLockLost on every process if process 0's lock was taken over (they stop together)."""
    lost = None
    if lock is not None:
        try:
            lock.check()
        except WorkdirLockLost as error:
            lost = error
    if not _on_every_process(lost is None) and lost is None:
        lost = WorkdirLockLost("process 0 lost the workdir lock to another job (its log names it)")
    if lost is not None:
        raise lost


def release_workdir(workdir: str, lock: WorkdirLock) -> None:
    if _HELD_LOCKS.get(_lock_key(workdir)) is lock:
        del _HELD_LOCKS[_lock_key(workdir)]
    lock.release()


def _on_every_process(ok: bool) -> bool:
    """Process 0's answer, on every process."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils
    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


def _lock_key(workdir: str) -> str:
    return os.path.realpath(workdir) if is_local(workdir) else workdir


_HELD_LOCKS: dict[str, WorkdirLock] = {}  # this process's workdir locks, by real path or URL
