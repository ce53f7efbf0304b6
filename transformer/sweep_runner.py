"""Running a sweep (its points built by transformer/sweep.py's `axis`, `product` and `zip` in a config's
`get_sweep()`): validated before anything launches, run as `train.py` processes (one after another, N at a time,
or as SLURM array scripts); transformer/sweep_results.py collects them.

Each point runs as its own `python train.py --workdir=SWEEP_DIR/<name> --config.k=v ...` process rather than
in a loop over the trainer: a NaN, a crash or an out-of-memory kill stays in its process, device memory is
released between runs, and the command in a run's sweep.log can be rerun by hand. Resuming is train.py's
own: a workdir with checkpoints continues from the latest one.

This module reads the ConfigDict only to apply and check overrides; the semantic checks are the trainer's
settings', imported lazily so that `--collect` stays light.
"""

from __future__ import annotations

import builtins
import copy
import dataclasses
import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable

import ml_collections

from transformer import files
from transformer.files import write_json
from transformer.sweep import SweepError
from transformer.workdir import CONFIG_FILE, LOCK_FILE, pid_alive, read_lock, stale_reason, this_machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_SCRIPT = os.path.join(ROOT, "train.py")
SWEEP_SCRIPT = os.path.join(ROOT, "scripts", "sweep.py")
MANIFEST = "sweep.json"  # in the sweep dir: the config, the points and their names (what --collect reads)
STATUS = "sweep_status.json"  # in each run's workdir: pid/host while running, exit code and error after
LOG = "sweep.log"  # in each run's workdir: the child's stdout and stderr, every attempt appended
ATTEMPT = "=== sweep attempt"  # opens each attempt's part of sweep.log
SCALARS = (bool, int, float, str)


# ----------------------------------------------------------------------------------------------------
# Run names


def name_value(value: Any) -> str:
    """A value as it appears in a run name: short (0.1, 1e-09, 4000) but never ambiguous for floats."""
    if isinstance(value, float) and not isinstance(value, bool):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    return str(value)


def swept_keys(points: list[dict]) -> list[str]:
    """The keys whose value differs between points (or is missing from some), in first-seen order: the
    sweep's axes. Keys set alike in every point are shared settings and stay out of names."""
    keys = list(dict.fromkeys(key for point in points for key in point))
    missing = object()
    return [key for key in keys if len({repr(point.get(key, missing)) for point in points}) > 1]


def run_names(points: list[dict]) -> list[str]:
    """`leaf=value` of each swept key, comma-joined: 'warmup_steps=100,dropout_rate=0.1'. A leaf shared by
    two swept keys (data.max_length, model.max_length) keeps its full dotted key. A single point is named by
    all its overrides ('base' when it has none). Names are file names: other characters become '_'."""
    keys = swept_keys(points) if len(points) > 1 else list(points[0]) if points else []
    leaves = [key.rsplit(".", 1)[-1] for key in keys]
    labels = {key: leaf if leaves.count(leaf) == 1 else key for key, leaf in builtins.zip(keys, leaves)}
    names = []
    for point in points:
        parts = [f"{labels[key]}={name_value(point[key])}" for key in keys if key in point]
        name = re.sub(r"[^A-Za-z0-9._+=,-]", "_", ",".join(parts)) or "base"
        if len(name) > 120:  # keep a workdir name well under file-system limits
            name = f"{name[:100]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
        names.append(name)
    seen: dict[str, int] = {}
    for index, name in enumerate(names):
        if name in seen:
            raise SweepError(f"points {seen[name]} and {index} have the same name {name!r}: "
                             f"the same overrides twice ({points[index]})")
        seen[name] = index
    return names


# ----------------------------------------------------------------------------------------------------
# Loading a config file and its sweep


def load_module(path: str):
    """Import a Python file by path (configs/X.py or a sweep file anywhere); ROOT is made importable
    so that `from configs import default` and `from transformer import sweep` work inside it."""
    if not os.path.isfile(path):
        raise SweepError(f"{path}: no such file")
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    name = "_sweep_" + re.sub(r"\W", "_", os.path.abspath(path))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def split_spec(spec: str) -> tuple[str, str | None]:
    """'configs/multi30k.py:/data/m30k' -> (path, argument), as ml_collections' --config reads it."""
    path, sep, argument = spec.partition(":")
    return path, (argument if sep else None)


def load_config(config_spec: str) -> ml_collections.ConfigDict:
    path, argument = split_spec(config_spec)
    module = load_module(path)
    return module.get_config() if argument is None else module.get_config(argument)


def load_sweep(config_spec: str, sweep_spec: str | None = None) -> list[dict[str, Any]]:
    """The points of `sweep_spec` ('file.py' or 'file.py:function'; default: the config file's get_sweep)."""
    path, function = split_spec(sweep_spec or split_spec(config_spec)[0])
    function = function or "get_sweep"
    module = load_module(path)
    if not hasattr(module, function):
        raise SweepError(f"{path} defines no {function}(); define it (a list of override dicts) or pass "
                         f"--sweep=file.py[:function]")
    points = getattr(module, function)()
    if not isinstance(points, list) or not points or not all(
            isinstance(p, dict) and all(isinstance(k, str) for k in p) for p in points):
        raise SweepError(f"{path}:{function}() must return a non-empty list of dicts with dotted string keys, "
                         f"got {points!r:.200}")
    return points


# ----------------------------------------------------------------------------------------------------
# Validation: every point against the config, before anything launches


@dataclasses.dataclass
class Point:
    name: str
    overrides: dict[str, Any]
    config: ml_collections.ConfigDict  # the config with this point's overrides applied
    problem: str | None = None  # why settings.Settings refuses this config (an invalid point), else None

    @property
    def num_train_steps(self) -> int:
        return int(self.config.train.num_train_steps)

    @property
    def target(self) -> dict[str, Any]:
        """The settings that decide where its run ends: a step count, and a time budget that may end it first."""
        return {"num_train_steps": self.num_train_steps,
                "max_train_minutes": float(self.config.train.get("max_train_minutes", 0.0))}


def _type_error(key: str, old: Any, value: Any) -> str | None:
    """ml_collections accepts True for an int field and None anywhere; the command line could carry
    neither faithfully, so a value must have its field's type (an int is fine for a float)."""
    if not isinstance(value, SCALARS):
        return f"{key}={value!r}: only bool, int, float and str values can be swept"
    if old is None:
        return None
    if isinstance(old, bool) or isinstance(value, bool):
        ok = isinstance(old, bool) and isinstance(value, bool)
    elif isinstance(old, float):
        ok = isinstance(value, (int, float))
    else:
        ok = type(value) is type(old)
    return None if ok else (f"{key}={value!r} has type {type(value).__name__}; the config's {key} has type "
                            f"{type(old).__name__}")


def apply_override(config: ml_collections.ConfigDict, key: str, value: Any) -> str | None:
    """Set config[key] (dotted); returns what is wrong (an unknown key, a wrong type) instead of raising, so
    that every bad override of every run can be reported at once."""
    *sections, field = key.split(".")
    node, path = config, []
    for section in sections:
        path.append(section)
        if section not in node or not isinstance(node[section], ml_collections.ConfigDict):
            return f"unknown key {key!r} (no section {'.'.join(path)!r})"
        node = node[section]
    if field not in node:
        return f"unknown key {key!r}; {'.'.join(sections) or 'the config'} has {sorted(node.keys())}"
    if isinstance(node[field], ml_collections.ConfigDict):
        return f"{key!r} is a section, not a setting"
    problem = _type_error(key, node[field], value)
    if problem:
        return problem
    try:
        node[field] = value
    except (TypeError, KeyError, AttributeError) as error:
        return f"{key}={value!r}: {error}"
    return None


def settings_problem(config: ml_collections.ConfigDict) -> str | None:
    """What settings.Settings.from_config (the same check train.py runs first) says about a config."""
    from transformer.settings import Settings  # imports jax: only where points are validated

    try:
        Settings.from_config(config)
    except (ValueError, TypeError) as error:
        return str(error).splitlines()[0]
    return None


def make_points(config_spec: str, overrides: list[dict[str, Any]]) -> list[Point]:
    """Name and check every point. A key the config lacks or a value of the wrong type raises SweepError
    naming each such run and key; a config that Settings refuses (num_heads not dividing emb_dim) makes an
    invalid point (Point.problem), which the caller reports and skips only when asked to."""
    base = load_config(config_spec)
    base.lock()
    names = run_names(overrides)
    points, errors = [], []
    for name, point_overrides in builtins.zip(names, overrides):
        config = copy.deepcopy(base)
        for key, value in point_overrides.items():
            problem = apply_override(config, key, value)
            if problem:
                errors.append(f"run {name!r}: {problem}")
        points.append(Point(name, dict(point_overrides), config))
    if errors:
        raise SweepError(f"{len(errors)} bad override(s); nothing was launched:\n  " + "\n  ".join(errors))
    for point in points:
        point.problem = settings_problem(point.config)
    return points


def refuse_invalid(points: list[Point], skip_invalid: bool) -> list[Point]:
    """The valid points; with invalid ones present and no skip_invalid, a SweepError listing them by name."""
    invalid = [p for p in points if p.problem]
    if invalid and not skip_invalid:
        lines = "\n  ".join(f"{p.name}: {p.problem}" for p in invalid)
        raise SweepError(f"{len(invalid)} of {len(points)} points are invalid; nothing was launched (pass "
                         f"--skip_invalid to run the other {len(points) - len(invalid)}):\n  {lines}")
    return [p for p in points if not p.problem]


# ----------------------------------------------------------------------------------------------------
# Commands and device slots


def cli_value(value: Any) -> str:
    """A value as --config.k=v: repr for floats, so that config_flags parses back exactly the same number."""
    return repr(value) if isinstance(value, float) else str(value)


def train_command(config_spec: str, workdir: str, overrides: dict[str, Any]) -> list[str]:
    return [sys.executable, TRAIN_SCRIPT, f"--config={config_spec}", f"--workdir={workdir}",
            *(f"--config.{key}={cli_value(value)}" for key, value in overrides.items())]


@dataclasses.dataclass
class Slot:
    """Where one child runs: environment additions and, on CPU, the cores it is pinned to."""

    label: str
    env: dict[str, str]
    cpus: list[int] | None = None


def visible_gpus() -> list[str]:
    """CUDA_VISIBLE_DEVICES when set, else what nvidia-smi lists, else none (a CPU machine)."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip() and d.strip() != "-1"]
    if not shutil.which("nvidia-smi"):
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in listing.splitlines() if line.strip()]


def _split(items: list, parts: int) -> list[list]:
    """items in `parts` contiguous groups as even as possible; with fewer items than parts, shared round-robin."""
    if len(items) < parts:
        return [[items[i % len(items)]] for i in range(parts)]
    size, extra = divmod(len(items), parts)
    groups, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        groups.append(items[start:end])
        start = end
    return groups


def device_slots(parallel: int, gpus: list[str] | None = None, cpus: list[int] | None = None) -> list[Slot]:
    """`parallel` slots that share the machine without fighting over it.

    GPUs: each child sees its own CUDA_VISIBLE_DEVICES group; with more children than GPUs, they share and
    stop preallocating GPU memory. CPU: each child is pinned (sched_setaffinity) to its own cores, XLA sees one
    host device, and OMP threads match the cores; a one-core child also turns off XLA's multi-threaded Eigen.
    Pinning keeps each child on its own cores whatever threads it starts, so N children never fight over
    one core. parallel=1 changes nothing: the run gets the whole machine."""
    if parallel <= 1:
        return [Slot("all devices", {})]
    gpus = visible_gpus() if gpus is None else gpus
    if gpus:
        shared = len(gpus) < parallel
        return [Slot(f"GPU {','.join(group)}", {"CUDA_VISIBLE_DEVICES": ",".join(group),
                                                 **({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"} if shared else {})})
                for group in _split(gpus, parallel)]
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    slots = []
    for group in _split(cpus, parallel):
        flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
        if len(group) == 1:
            flags += " --xla_cpu_multi_thread_eigen=false"
        threads = str(len(group))
        slots.append(Slot(f"CPU {','.join(map(str, group))}", {
            "XLA_FLAGS": flags.strip(), "OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads}, group))
    return slots


# ----------------------------------------------------------------------------------------------------
# Status of a run: done, failed, running


# The records a sweep reads (its own sweep_status.json, a run's scores.json) are read with cache=True: one torn by a
# kill is warned about and read as absent, so that the sweep goes on.
def is_complete(workdir: str, target: dict[str, Any]) -> bool:
    """train.py writes scores.json last, recording why the run ended and the settings that decided it
    (`end`): a run is finished when those are the point's `target`, whether it reached num_train_steps or its
    time budget ended it first. A scores.json without `end` (older runs) counts at the step count only."""
    scores = files.read_json(os.path.join(workdir, "scores.json"), None, cache=True)
    if not scores:
        return False
    end = scores.get("end")
    if end is None:
        return scores.get("step") == target["num_train_steps"]
    return all(end.get(key) == value for key, value in target.items() if value is not None)


def is_done(point: Point, workdir: str) -> bool:
    """Complete, and by this point's config: a workdir trained with other shared overrides (names hold only
    the swept keys) is not skipped; relaunching it lets train.py refuse it, naming the difference."""
    if not is_complete(workdir, point.target):
        return False
    from transformer.settings import check_resume_config  # imports jax: only for a finished run

    saved = files.read_json(os.path.join(workdir, CONFIG_FILE), None, cache=True)
    try:
        check_resume_config(saved or {}, point.config)
    except ValueError:
        return False
    return True


REPORTED_PREFIX = "error: "  # how the entry points print the project's errors (transformer/errors.py)
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit|Failure)(?::|$)")


def error_line(log_text: str) -> str:
    """The first line of the error: the message of train.py's last 'error: <message>' line, else the last line
    that looks like 'SomeError: message' (a traceback's last line), else the last non-empty line. Only the latest
    attempt in the log counts."""
    before, marker, latest = log_text.rpartition(ATTEMPT)
    log_text = latest.split("\n", 1)[-1] if marker else log_text  # without the attempt's header line
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith(REPORTED_PREFIX):
            return line[len(REPORTED_PREFIX):][:300]
    for line in reversed(lines):
        if EXCEPTION_LINE.match(line):
            return line[:300]
    return lines[-1][:300] if lines else ""


def read_tail(path: str, size: int = 65536) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, os.path.getsize(path) - size))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


# A run on another host is judged by its workdir lock as train.py's own lock is: gone once no heartbeat came for this
# long (or, with no lock at all, this long after its start).
LOST_AFTER_SECONDS = 600.0


def lost_reason(workdir: str, status: dict, now: float | None = None) -> str | None:
    """Why a run recorded as running is known to be gone (killed hard: SIGKILL, an OOM kill, a lost node), or
    None while it may live. On this host its pid decides; on another (a SLURM node) its workdir lock's heartbeat."""
    now = time.time() if now is None else now
    if status.get("host") == socket.gethostname():
        pid = int(status.get("pid", 0))
        return None if pid_alive(pid) else f"pid {pid} is no longer running on this host"
    lock = read_lock(os.path.join(workdir, LOCK_FILE))
    if lock is None:
        age = now - float(status.get("started") or 0.0)
        return (f"no job has held its workdir lock in the {format_seconds(age)} since it started on "
                f"{status.get('host')}" if age > LOST_AFTER_SECONDS else None)
    holder, _, modified = lock
    reason = stale_reason(holder, modified=modified, now=now, stale_after_seconds=LOST_AFTER_SECONDS,
                          machine=this_machine())
    return f"its workdir lock is stale: {reason}" if reason else None


def run_state(workdir: str, target: dict[str, Any]) -> tuple[str, dict]:
    """(state, status file) of a run: done | failed | running | stopped | pending.

    The latest attempt decides: 'running' while its process may live ('stopped' when it is known gone:
    `lost_reason`, or interrupted), 'failed' when it exited non-zero; 'done' when scores.json says it ended at
    the point's `target` (however its wrapper ended after that), else 'pending' (never launched, or launched
    with a smaller target)."""
    status = files.read_json(os.path.join(workdir, STATUS), None, cache=True) or {}
    state = status.get("state")
    if state == "running":
        lost = lost_reason(workdir, status)
        if lost is None:
            return "running", status
        state, status = "stopped", {**status, "error": f"killed hard: {lost}"}
    if state == "exited" and status.get("returncode"):
        return "failed", status
    if is_complete(workdir, target):
        return "done", status
    return ("stopped" if state == "stopped" else "pending"), status


# ----------------------------------------------------------------------------------------------------
# Running: one after another or N at a time


def write_manifest(sweep_dir: str, config_spec: str, sweep_spec: str | None, points: list[Point]) -> None:
    """sweep.json: what --collect needs without the config (names, overrides, axes, step targets)."""
    os.makedirs(sweep_dir, exist_ok=True)
    write_json(os.path.join(sweep_dir, MANIFEST), {
        "config": config_spec, "sweep": sweep_spec, "axes": swept_keys([p.overrides for p in points]),
        "runs": [{"name": p.name, "overrides": p.overrides, **p.target, "invalid": p.problem} for p in points]})


@dataclasses.dataclass
class Child:
    point: Point
    slot: Slot
    process: subprocess.Popen
    workdir: str
    started: float
    previous_seconds: float


def start(point: Point, slot: Slot, sweep_dir: str, config_spec: str) -> Child:
    """Launch train.py for one point, its output appended to workdir/sweep.log, and mark it running."""
    workdir = os.path.join(sweep_dir, point.name)
    os.makedirs(workdir, exist_ok=True)
    previous = files.read_json(os.path.join(workdir, STATUS), None, cache=True) or {}
    command = train_command(config_spec, workdir, point.overrides)
    log_file = open(os.path.join(workdir, LOG), "a", encoding="utf-8")
    log_file.write(f"\n{ATTEMPT} {time.strftime('%Y-%m-%d %H:%M:%S')} on {slot.label}: {shlex.join(command)}\n")
    log_file.flush()
    pin = (lambda: os.sched_setaffinity(0, slot.cpus)) if slot.cpus else None
    # Own session: a Ctrl-C reaches the sweep, which stops its children and records them as stopped.
    process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **slot.env},
                               preexec_fn=pin, start_new_session=True)
    log_file.close()
    child = Child(point, slot, process, workdir, time.time(), float(previous.get("total_wall_seconds", 0.0)))
    write_json(os.path.join(workdir, STATUS), {
        "state": "running", "pid": process.pid, "host": socket.gethostname(), "slot": slot.label,
        "started": child.started, "command": command, "total_wall_seconds": child.previous_seconds})
    return child


def finish(child: Child, state: str = "exited") -> dict:
    """Record how the child ended: exit code, first line of its error, wall time (summed over attempts)."""
    returncode = child.process.wait()
    elapsed = time.time() - child.started
    status = files.read_json(os.path.join(child.workdir, STATUS), None, cache=True) or {}
    error = ""
    if returncode:
        error = error_line(read_tail(os.path.join(child.workdir, LOG)))
        if returncode < 0:
            error = f"killed by {signal.Signals(-returncode).name}" + (f"; {error}" if error else "")
    status.update(state=state, returncode=returncode, error=error, ended=time.time(), wall_seconds=elapsed,
                  total_wall_seconds=child.previous_seconds + elapsed)
    write_json(os.path.join(child.workdir, STATUS), status)
    return status


def format_seconds(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:
        return ""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


STOP_SIGNAL_LEAD_SECONDS = 300  # the emitted SLURM scripts' --signal=TERM@300, as scripts/slurm_train.sbatch's
EXIT_PREEMPTED = 75  # train.py's status after a stop signal with its checkpoint committed (transformer/loop.py)
# How long a stopped sweep waits for its runs to commit their checkpoints before it kills them: within the 300 s
# that the emitted SLURM scripts ask between the stop signal and the time limit (--signal=TERM@300).
STOP_GRACE_SECONDS = 240.0


class SweepStopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped the sweep; `resumable` when every run it stopped committed its checkpoint (exit
    75), so that the same command goes on from there (a SLURM script then requeues itself)."""

    def __init__(self, message: str, resumable: bool = False):
        super().__init__(message)
        self.resumable = resumable


def _raise_interrupt(signum, frame):
    raise SweepStopped(f"signal {signum}")


def stop_children(running: list, results: dict[str, int], echo: Callable[[str], None]) -> None:
    """SIGTERM every running child, give them STOP_GRACE_SECONDS together to commit, and record them as stopped;
    a second SIGTERM or Ctrl-C meanwhile kills them at once, so that no child outlives the sweep."""
    for child in running:
        child.process.terminate()

    def hurry(signum, frame):
        os.write(2, f"{signal.Signals(signum).name} again: killing the runs; each keeps its last committed "
                    f"checkpoint\n".encode())
        for child in running:
            if child.process.poll() is None:
                child.process.kill()
    signal.signal(signal.SIGTERM, hurry)
    previous_interrupt = signal.signal(signal.SIGINT, hurry)
    try:
        deadline = time.time() + STOP_GRACE_SECONDS
        for child in running:
            try:
                child.process.wait(timeout=max(deadline - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                child.process.kill()
            status = finish(child, state="stopped")
            results[child.point.name] = status["returncode"]
            echo(f"{child.point.name}: stopped (exit {status['returncode']}); rerun the same command to resume it")
    finally:
        signal.signal(signal.SIGINT, previous_interrupt)


def run_points(points: list[Point], sweep_dir: str, config_spec: str, parallel: int = 1,
               echo: Callable[[str], None] = print) -> dict[str, int]:
    """Run every point not yet done, `parallel` at a time; returns {name: exit code} of those launched.

    A failing run is recorded and the others go on; a run that exits 75 by itself (a stop signal sent to it)
    is recorded as stopped. On Ctrl-C or SIGTERM the running children are sent SIGTERM, given
    STOP_GRACE_SECONDS to commit their checkpoints, recorded as stopped, and SweepStopped is raised; the same
    command later resumes them from their checkpoints."""
    todo = []
    for point in points:
        workdir = os.path.join(sweep_dir, point.name)
        state, status = run_state(workdir, point.target)
        if is_done(point, workdir):
            echo(f"skip {point.name}: done")
        elif state == "running" and status.get("host") == socket.gethostname():  # two trainers, one workdir: no
            echo(f"skip {point.name}: already running as pid {status.get('pid')} (another sweep of this directory)")
        else:
            todo.append(point)
    # Fewer runs left than slots (a resumed sweep): each gets a larger share of the machine.
    free, running, results = device_slots(min(parallel, max(len(todo), 1))), [], {}
    total = len(todo)
    previous_handler = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        while todo or running:
            while todo and free:
                child = start(todo.pop(0), free.pop(0), sweep_dir, config_spec)
                running.append(child)
                echo(f"[{total - len(todo)}/{total}] start {child.point.name} on {child.slot.label} "
                     f"(pid {child.process.pid}, log {os.path.join(child.workdir, LOG)})")
            time.sleep(0.2)
            for child in [c for c in running if c.process.poll() is not None]:
                running.remove(child)
                free.append(child.slot)
                stopped = child.process.returncode == EXIT_PREEMPTED
                status = finish(child, state="stopped" if stopped else "exited")
                results[child.point.name] = code = status["returncode"]
                outcome = ("stopped with its checkpoint committed (exit 75): rerun the same command to resume it"
                           if stopped else f"failed (exit {code}): {status['error']}" if code else "done")
                echo(f"{child.point.name}: {outcome} in {format_seconds(status['wall_seconds'])}")
    except KeyboardInterrupt as interrupt:
        stop_children(running, results, echo)
        resumable = bool(running) and all(c.process.returncode == EXIT_PREEMPTED for c in running)
        raise SweepStopped(str(interrupt), resumable) from None
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    return results


# ----------------------------------------------------------------------------------------------------
# SLURM: one script per run and an array over them, nothing run


def sweep_args(config_spec: str, sweep_spec: str | None, sweep_dir: str, skip_invalid: bool) -> list[str]:
    """The scripts/sweep.py flags that name this sweep: what each SLURM script passes on."""
    return [f"--config={config_spec}", *([f"--sweep={sweep_spec}"] if sweep_spec else []),
            f"--sweep_dir={sweep_dir}", *(["--skip_invalid"] if skip_invalid else [])]


def emit_slurm(points: list[Point], sweep_dir: str, config_spec: str, sweep_spec: str | None = None,
               skip_invalid: bool = False, options: list[str] = (), setup: list[str] = (),
               max_running: int = 0) -> list[str]:
    """Write sweep_dir/slurm/<name>.sh per point (each submittable alone with sbatch), runs.txt (one script
    per line) and array.sbatch (#SBATCH --array=0-(N-1), task i runs line i+1); run nothing. Each script
    calls `scripts/sweep.py ... --only=<name>`, so that on the cluster too a finished run is skipped, an
    unfinished one resumes, and its status and log land in its workdir for --collect."""
    slurm_dir = os.path.join(sweep_dir, "slurm")
    logs = os.path.join(slurm_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    # As scripts/slurm_train.sbatch: SIGTERM to the run 5 minutes before the time limit, whose checkpoint it commits
    # (exit 75), and then the job requeues itself; the log is appended to across attempts.
    stop = [f"#SBATCH --signal=TERM@{STOP_SIGNAL_LEAD_SECONDS}", "#SBATCH --requeue", "#SBATCH --open-mode=append"]
    extra = [*stop, *(f"#SBATCH {option if option.startswith('-') else '--' + option}" for option in options)]
    python = f'"${{PYTHON:-{sys.executable}}}"'
    scripts = []
    for index, point in enumerate(points):
        command = [SWEEP_SCRIPT, *sweep_args(config_spec, sweep_spec, sweep_dir, skip_invalid), f"--only={point.name}"]
        train = shlex.join(train_command(config_spec, os.path.join(sweep_dir, point.name), point.overrides)[1:])
        lines = ["#!/bin/bash", f"#SBATCH --job-name={point.name[:100]}",
                 f"#SBATCH --output={logs}/{point.name}-%j.out", *extra,
                 f"# Sweep point {index + 1} of {len(points)}. It trains: python {train}",
                 "# through scripts/sweep.py --only, which skips it when done, resumes it from its checkpoints",
                 "# otherwise, and records sweep_status.json and sweep.log in its workdir. PYTHON=... picks the",
                 "# interpreter. Under SLURM it runs as a job step (srun), which --signal reaches; exit status 75",
                 "# (stopped, checkpoint committed) requeues the job, whose next start resumes the run.",
                 "set -euo pipefail", f"cd {shlex.quote(os.getcwd())}", *setup,
                 'launch=()', 'if [ -n "${SLURM_JOB_ID:-}" ]; then launch=(srun --ntasks=1); fi', "status=0",
                 f'${{launch[@]+"${{launch[@]}}"}} {python} {shlex.join(command)} || status=$?',
                 f'if [ "$status" -eq {EXIT_PREEMPTED} ] && [ -n "${{SLURM_JOB_ID:-}}" ]; then',
                 '    scontrol requeue "$SLURM_JOB_ID"', "fi", 'exit "$status"', ""]
        path = os.path.join(slurm_dir, f"{point.name}.sh")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write("\n".join(lines))
        os.chmod(path, 0o755)
        scripts.append(path)
    with open(os.path.join(slurm_dir, "runs.txt"), "w", encoding="utf-8") as handle:
        handle.writelines(path + "\n" for path in scripts)
    limit = f"%{max_running}" if max_running > 1 else ""
    array = ["#!/bin/bash", f"#SBATCH --job-name=sweep-{os.path.basename(os.path.normpath(sweep_dir))}",
             f"#SBATCH --array=0-{len(scripts) - 1}{limit}", f"#SBATCH --output={logs}/%A_%a.out", *extra,
             f"# {len(scripts)} runs, one per array task: task i runs line i+1 of runs.txt.", "set -euo pipefail",
             f'script=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {shlex.quote(os.path.join(slurm_dir, "runs.txt"))})',
             'exec bash "$script"', ""]
    with open(os.path.join(slurm_dir, "array.sbatch"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(array))
    return scripts
