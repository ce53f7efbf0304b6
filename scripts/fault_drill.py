"""The fault drill: train a small job with train.py, interrupt it again and again with SIGTERM, SIGINT and SIGKILL
(some while an asynchronous save is being written), resume each time with the same command, then check that every
committed checkpoint restores and that the final parameters are bitwise equal to an uninterrupted run's.

    python scripts/fault_drill.py                      # 10 interruptions
    python scripts/fault_drill.py --interruptions=3 --steps=120
    python scripts/fault_drill.py --time_sigterm --config=configs/base.py --config.data.source=builtin ...

Its last line:

    fault drill: 10 interruptions (3 SIGTERM, 3 SIGINT, 4 SIGKILL), 10 resumes, 0 checkpoints lost, 0 steps lost
    to SIGTERM/SIGINT, final parameters bitwise equal: yes

A checkpoint is lost when one committed before an interruption is gone or unreadable after it (the drill keeps
every checkpoint, so none leaves by keep-N). Steps are lost to SIGTERM/SIGINT when the run's newest committed
checkpoint after it stopped is older than the step it stopped at (the run should save the step it was on).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A small job with enough steps to interrupt at many points, a checkpoint every 10 steps and every one kept.
OVERRIDES = {
    "data.builtin_train_size": 3000, "data.builtin_valid_size": 64, "data.builtin_test_size": 64,
    "data.vocab_size": 300, "data.max_length": 48, "data.tokens_per_batch": 768,
    "model.emb_dim": 64, "model.num_heads": 2, "model.num_encoder_layers": 2, "model.num_decoder_layers": 2,
    "model.mlp_dim": 128, "optimizer.warmup_steps": 20, "train.log_every_steps": 5, "train.eval_every_steps": 0,
    "train.checkpoint_every_steps": 10, "train.keep_checkpoints": 1000, "decode.bleu_splits": "",
    "decode.average_last": 3,
}
STEP_LINE = re.compile(r"step (\d+): loss")
STOP_LINE = re.compile(r"stopped at step (\d+) with its checkpoint committed")
EXIT_PREEMPTED = 75


def command(workdir: str, steps: int) -> list[str]:
    overrides = {**OVERRIDES, "train.num_train_steps": steps}
    return [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={workdir}",
            *(f"--config.{key}={value}" for key, value in overrides.items())]


def committed_steps(workdir: str) -> list[int]:
    """The steps Orbax has committed (a step directory renamed into place; unfinished ones carry a tmp suffix)."""
    directory = os.path.join(workdir, "checkpoints")
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit()) if os.path.isdir(directory) else []


def saving(workdir: str, since: float) -> bool:
    """Whether an asynchronous save is being written now: an Orbax temporary step directory made after `since`
    (one left by an earlier SIGKILL stays until its step is saved again, and does not count)."""
    directory = os.path.join(workdir, "checkpoints")
    try:
        return any("tmp" in name and os.path.getmtime(os.path.join(directory, name)) >= since
                   for name in os.listdir(directory))
    except OSError:  # the directory or the temporary one vanished between the listing and the look
        return False


class Job:
    """One train.py process, its output read line by line in a thread (the last logged step, the stop line)."""

    def __init__(self, workdir: str, steps: int, log_path: str):
        self.log = open(log_path, "a", encoding="utf-8")
        environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command(workdir, steps), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env=environment, cwd=ROOT)
        self.last_step, self.stopped_at = 0, None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.log.write(line)
            if match := STEP_LINE.search(line):
                self.last_step = int(match.group(1))
            if match := STOP_LINE.search(line):
                self.stopped_at = int(match.group(1))

    def wait(self, timeout: float = 600) -> int:
        code = self.process.wait(timeout=timeout)
        self.reader.join(timeout=30)
        self.log.flush()
        return code


def check_restores(workdir: str, steps: list[int]) -> list[int]:
    """The steps among `steps` whose train state and data state do not restore."""
    import jax
    from transformer import sharding
    from transformer.checkpoint import Checkpointer
    from transformer.plan import make_plan, recorded_batch
    from transformer.restore import load_workdir_config
    from transformer.settings import Settings
    from transformer.tokenizer import Tokenizer

    settings = Settings.from_config(load_workdir_config(workdir))
    mesh = sharding.make_mesh(settings.mesh)
    plan = make_plan(settings, Tokenizer(os.path.join(workdir, "vocab.model")).vocab_size, mesh, recorded_batch(workdir))
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), save_every_steps=1, keep=1, use_async=False,
                                read_only=True)
    failed = []
    for step in steps:
        try:
            state = checkpointer.restore(plan.abstract_state(settings.seed), step)
            assert int(state.step) == step and checkpointer.restore_data_state(step) is not None
            jax.block_until_ready(state)
        except Exception as error:  # any failure to read counts as a lost checkpoint, and is named
            print(f"checkpoint {step} of {workdir} does not restore: {type(error).__name__}: {error}")
            failed.append(step)
    checkpointer.close()
    return failed


def final_params_equal(reference: str, drilled: str) -> bool:
    import jax
    import numpy as np
    from transformer.restore import restore

    a, b = (jax.device_get(restore(w).params) for w in (reference, drilled))
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(leaves_a) == len(leaves_b) and all(
        x.dtype == y.dtype and x.shape == y.shape and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(leaves_a, leaves_b))


def time_sigterm(train_args: list[str], root: str, after_step: int = 3) -> int:
    """Seconds from a SIGTERM, sent once `after_step` is logged, to train.py's exit (its step finished and its
    checkpoint committed): what a cluster's grace period must cover. `train_args`: train.py's config flags."""
    workdir, log_path = os.path.join(root, "sigterm"), os.path.join(root, "sigterm.log")
    if os.path.exists(workdir):
        sys.exit(f"{workdir} exists: choose another --workdir")
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={workdir}",
                                    *train_args, "--config.train.log_every_steps=1"], stdout=log,
                                   stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        while process.poll() is None:
            with open(log_path, encoding="utf-8") as handle:
                if re.search(rf"step {after_step}: loss", handle.read()):
                    break
            time.sleep(0.01)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait()
        seconds = time.monotonic() - sent
    text = open(log_path, encoding="utf-8").read()
    params = re.search(r"model: ([\d,]+) parameters", text)
    stopped = STOP_LINE.search(text)
    print(f"SIGTERM to exit: {seconds:.2f}s (exit {code}; {params.group(1) if params else '?'} parameters; "
          f"stopped at step {stopped.group(1) if stopped else '?'}, committed: {committed_steps(workdir)}); log: "
          f"{log_path}")
    return 0 if code == EXIT_PREEMPTED and stopped else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interruptions", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200, help="train.num_train_steps of the drilled job")
    parser.add_argument("--seed", type=int, default=0, help="chooses the signals' order and moments")
    parser.add_argument("--workdir", default=None, help="where the two runs go (default: a new temporary directory)")
    parser.add_argument("--time_sigterm", action="store_true",
                        help="instead of the drill: time one SIGTERM of train.py run with the remaining arguments")
    args, train_args = parser.parse_known_args()
    if args.time_sigterm:
        return time_sigterm(train_args, args.workdir or tempfile.mkdtemp(prefix="fault_drill_"))
    if train_args:
        parser.error(f"unrecognized arguments: {' '.join(train_args)} (train.py flags go with --time_sigterm)")
    if args.interruptions < 1 or args.steps < 2 * args.interruptions:
        parser.error("--interruptions must be >= 1 and --steps at least twice as many")
    root = args.workdir or tempfile.mkdtemp(prefix="fault_drill_")
    reference, drilled = os.path.join(root, "uninterrupted"), os.path.join(root, "interrupted")
    for path in (reference, drilled):
        if os.path.exists(path):
            sys.exit(f"{path} exists: the drill needs new workdirs (choose another --workdir)")
    log_path = os.path.join(root, "drill.log")
    print(f"fault drill in {root} (train.py output in {log_path})", flush=True)

    code = Job(reference, args.steps, log_path).wait()
    if code != 0:
        sys.exit(f"the uninterrupted run failed (exit {code}); see {log_path}")
    rng = random.Random(args.seed)
    third = args.interruptions // 3
    signals = ([signal.SIGTERM] * third + [signal.SIGINT] * third
               + [signal.SIGKILL] * (args.interruptions - 2 * third))
    rng.shuffle(signals)
    # The k-th interruption aims at a step spread over the run, so that every one finds training under way.
    targets = sorted(rng.randint(1, args.steps - 1) for _ in signals)
    lost_checkpoints, lost_steps, during_saves, failures, resumes = set(), 0, 0, [], 0
    for index, (signum, target) in enumerate(zip(signals, targets)):
        before = set(committed_steps(drilled))
        started = time.time()
        job = Job(drilled, args.steps, log_path)
        resumes += index > 0
        wait_for_save = rng.random() < 0.5
        while job.process.poll() is None and job.last_step < target:
            time.sleep(0.005)
        deadline = time.monotonic() + 5
        while (wait_for_save and job.process.poll() is None and not saving(drilled, started)
               and time.monotonic() < deadline):
            time.sleep(0.001)
        if job.process.poll() is not None:
            failures.append(f"run {index} ended (exit {job.process.returncode}) before its interruption at step "
                            f"{target}")
            break
        during_saves += saving(drilled, started)
        job.process.send_signal(signum)
        code = job.wait()
        after = set(committed_steps(drilled))
        lost_checkpoints |= before - after
        name = signal.Signals(signum).name
        if signum == signal.SIGKILL:
            ok = code == -signal.SIGKILL
        else:
            ok = code == EXIT_PREEMPTED and job.stopped_at is not None
            newest = max(after, default=0)
            lost_steps += max((job.stopped_at or job.last_step) - newest, 0)
        if not ok:
            failures.append(f"{name} at step ~{job.last_step}: exit {code}, stop line {job.stopped_at}")
        print(f"interruption {index + 1}: {name} after step {job.last_step} (exit {code}"
              f"{f', stopped at step {job.stopped_at}' if job.stopped_at else ''}); committed: "
              f"{max(after, default=0)}", flush=True)
    code = Job(drilled, args.steps, log_path).wait()
    resumes += 1
    if code != 0:
        failures.append(f"the last resume failed (exit {code})")
    unreadable = check_restores(drilled, committed_steps(drilled))
    lost_checkpoints |= set(unreadable)
    equal = code == 0 and final_params_equal(reference, drilled)
    for failure in failures:
        print(f"failure: {failure}")
    counts = {name: sum(s.name == name for s in signals) for name in ("SIGTERM", "SIGINT", "SIGKILL")}
    print(f"({during_saves} of the signals were sent while an asynchronous save was being written)")
    print(f"fault drill: {len(signals)} interruptions ({counts['SIGTERM']} SIGTERM, {counts['SIGINT']} SIGINT, "
          f"{counts['SIGKILL']} SIGKILL), {resumes} resumes, {len(lost_checkpoints)} checkpoints lost, {lost_steps} "
          f"steps lost to SIGTERM/SIGINT, final parameters bitwise equal: {'yes' if equal else 'no'}")
    return 0 if equal and not lost_checkpoints and not lost_steps and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
