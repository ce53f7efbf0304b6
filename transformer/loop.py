"""The training loop's periodic actions, in the spirit of clu's periodic actions: each is a small object with its
own trigger, and the loop (trainer.Loop) calls every action's hooks at every step without knowing what they do.

A step is a *sync step* when an action asks for one (a log, a checkpoint, a dev BLEU evaluation, the cooldown's
end, the time budget's projected end, a preemption) or it is the last step. Only there are the metrics fetched from
the devices (the loop's one host sync), and every save happens at a sync step after that fetch, so a non-finite
step is caught before anything is saved.

The hooks of an `Action`, in the order a step calls them (each action's default does nothing):
  before_step   before the step is dispatched (the cooldown begun by step count, a profile started)
  after_step    once the step is dispatched, not awaited (a profile stopped)
  syncs         whether this must be a sync step for the action; asked of every action at every step
  stop_reason   at a sync step: why the run stops here (the first action with a reason stops it), or None
  at_sync       at a sync step the run goes on from (a timed checkpoint, the cooldown begun by time, a report mark)
  off_the_clock after every step but the last (which the end of the run evaluates), off the training clock
  end_of_step   last: the periodic checkpoint
Each hook takes the loop, which offers what actions act on: `state`, `clock`, `budget`, `progress`,
`final_step`, `saved_at`, `save(step, force)`, `pace(step)`, `score_final()`, `write_reports(reports)`, and the
run's evaluations (`report_loss`, `report_dev_bleu`).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from typing import Any

import jax
import numpy as np

from transformer import optim
from transformer.console import log
from transformer.steps import summarize

# EX_TEMPFAIL from sysexits.h: a requeue script re-runs the same command on this status, which resumes the run.
EXIT_PREEMPTED = 75
NONFINITE_POLICIES = ("stop", "skip")


def agreed_seconds(seconds: float, timed: bool) -> float:
    """Process 0's training clock, on every process, when something is decided on it (timed: the time budget,
    the report marks, the cooldown): processes that decided differently would part ways at the next collective."""
    if jax.process_count() == 1 or not timed:
        return seconds
    from jax.experimental import multihost_utils
    return float(multihost_utils.broadcast_one_to_all(np.float32(seconds)))


class Action:
    """One of the loop's periodic actions (module docstring): it overrides the hooks it acts in."""

    def before_step(self, loop, step: int) -> None:
        pass

    def after_step(self, loop, step: int) -> None:
        pass

    def syncs(self, loop, step: int) -> bool:
        return False

    def stop_reason(self, loop, step: int) -> str | None:
        return None

    def at_sync(self, loop, step: int) -> None:
        pass

    def off_the_clock(self, loop, step: int) -> None:
        pass

    def end_of_step(self, loop, step: int) -> None:
        pass


class Every(Action):
    """Due at every multiple of `steps` (never when 0); then `run(loop, step)` off the training clock, and with
    `syncs` the step is a sync step (a log; a dev BLEU evaluation, which may save the best checkpoint: that must
    not hold a non-finite update)."""

    def __init__(self, steps: int, run=None, *, syncs: bool = False):
        self.steps, self.run, self.sync = steps, run, syncs

    def __call__(self, step: int) -> bool:
        return bool(self.steps) and step % self.steps == 0

    def syncs(self, loop, step: int) -> bool:
        return self.sync and self(step)

    def off_the_clock(self, loop, step: int) -> None:
        if self.run is not None and self(step):
            self.run(loop, step)


class Checkpoint(Action):
    """train.checkpoint_every_steps: a save at each multiple, at the end of its step (after its evaluations).
    The loop asks at every step, so that a failed asynchronous save stops the run within a step of it."""

    def __init__(self, steps: int):
        self.steps = steps

    def syncs(self, loop, step: int) -> bool:
        return step % self.steps == 0

    def end_of_step(self, loop, step: int) -> None:
        loop.save(step)


class Clock:
    """Training seconds: the loop's wall time less what runs `paused` (evaluation, scoring), counting from the
    seconds an earlier part of the run spent; agreed over processes when `timed` decisions depend on it."""

    def __init__(self, seconds: float, timed: bool, now=time.perf_counter):
        self.timed, self.now = timed, now
        self.seconds = agreed_seconds(seconds, timed)
        self.mark = now()

    def tick(self) -> float:
        """Move the clock to now; returns the wall seconds since the last tick (a logging window's length)."""
        now = self.now()
        elapsed, self.mark = now - self.mark, now
        self.seconds = agreed_seconds(self.seconds + elapsed, self.timed)
        return elapsed

    @contextlib.contextmanager
    def paused(self):
        start = self.now()
        try:
            yield
        finally:
            self.mark += self.now() - start


class NonFiniteError(FloatingPointError):
    """A step whose loss or gradient norm was not finite, under train.nonfinite=stop."""


class MetricsWindow:
    """The metrics of the steps since the last fetch, left on the devices until a sync step fetches them.

    A step's `nonfinite` flag is read here: under "stop" the first such step raises NonFiniteError (before the
    caller saves anything); under "skip" its update was not applied on the device, and the window's summary
    counts it (`skipped_updates`) and leaves it out of the averages, and once the run's total passes
    `max_skipped` raises NonFiniteError: a run that skips that often is diverging, not meeting a rare bad batch."""

    def __init__(self, first_step: int, policy: str = "stop", max_skipped: float = math.inf, skipped: int = 0):
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"train.nonfinite={policy!r} is not one of {NONFINITE_POLICIES}")
        self.policy, self.first_step, self.max_skipped = policy, first_step, max_skipped
        self.pending: list[dict[str, Any]] = []
        self.input_seconds = 0.0  # spent waiting for the next batch in this window
        self.skipped = skipped  # non-finite updates skipped so far in the run, earlier parts included

    def add(self, step_metrics: dict[str, Any]) -> None:
        self.pending.append(step_metrics)

    def fetch(self, last_checkpoint: str) -> dict[str, float]:
        """The window's summary; resets the window. `last_checkpoint` names the last good checkpoint for the error."""
        fetched = jax.device_get(self.pending)  # the loop's only host sync
        bad = [(self.first_step + i, m) for i, m in enumerate(fetched) if m.get("nonfinite", 0)]
        if bad and self.policy == "stop":
            step, values = bad[0]
            loss = float(values["loss"]) / max(float(values["denominator"]), 1.0)
            what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {float(values['grad_norm'])}"
            raise NonFiniteError(
                f"non-finite training {what} at step {step} (loss {loss:.4g}, gradient norm "
                f"{float(values['grad_norm']):.4g}); nothing was saved after it; last good checkpoint: "
                f"{last_checkpoint}. train.nonfinite=skip skips such updates; train.debug_nans=true finds the "
                "operation that made it")
        self.skipped += len(bad)
        if self.skipped > self.max_skipped:
            raise NonFiniteError(
                f"train.nonfinite=skip has skipped {self.skipped} non-finite updates by step "
                f"{self.first_step + len(fetched) - 1}, more than train.max_skipped_updates={self.max_skipped:g} "
                f"(first in this window: step {bad[0][0]}); nothing was saved after it; last good checkpoint: "
                f"{last_checkpoint}. A lower optimizer.learning_rate_scale or a longer warmup usually cures it")
        good = [m for _, m in enumerate(fetched) if not m.get("nonfinite", 0)]
        summary = summarize(good or fetched)
        summary["skipped_updates"] = len(bad)
        self.first_step += len(fetched)
        self.pending = []
        return summary


class TimeBudget(Action):
    """train.max_train_minutes: stop within a step of the budget. At each fetch it projects from the window's pace
    how many whole steps are left; with fewer than a log interval left it asks for a fetch at the step where it
    runs out (`check_step`), rather than at the first log step past it."""

    def __init__(self, minutes: float, log_every_steps: int):
        self.minutes, self.seconds = minutes, minutes * 60 or math.inf
        self.log_every_steps = log_every_steps
        self.steps_left = math.inf
        self.check_step: int | None = None

    @property
    def limited(self) -> bool:
        return self.seconds < math.inf

    def update(self, step: int, steps: int, seconds_before: float, seconds_now: float) -> None:
        """After a window of `steps` steps ending at `step` that took the clock from seconds_before to seconds_now
        (the agreed clock, so every process decides alike)."""
        step_seconds = (seconds_now - seconds_before) / max(steps, 1)
        self.steps_left = (self.seconds - seconds_now) / max(step_seconds, 1e-9)
        self.check_step = step + int(self.steps_left) if self.steps_left < self.log_every_steps else None

    def spent(self) -> bool:
        """Spent, or the next step would pass it."""
        return self.steps_left < 1

    def left(self, seconds: float) -> float:
        return max(self.seconds - seconds, 0.0)

    def syncs(self, loop, step: int) -> bool:
        return step == self.check_step

    def stop_reason(self, loop, step: int) -> str | None:
        if not self.spent():
            return None
        reason = (f"the time budget of train.max_train_minutes={self.minutes:g} is spent ({loop.clock.seconds:.0f}s "
                  f"of training{'' if self.steps_left <= 0 else ', less than a step of it left'})")
        loop.progress.write(f"step {step}: {reason}")
        return reason


class Cooldown(Action):
    """optimizer.cooldown_fraction: the learning rate's linear decay over the last fraction of the run. It begins
    at the last fraction of num_train_steps or, under a time budget, at (1 - fraction) of the budget, whichever
    comes first. The (start, end) window lives in the optimizer state once begun, so a resumed run keeps a decay it
    had begun, and num_train_steps may still change before it begins."""

    def __init__(self, fraction: float, num_train_steps: int, opt_state: Any, progress):
        self.fraction, self.num_train_steps, self.progress = fraction, num_train_steps, progress
        self.window = optim.cooldown_steps(opt_state)
        self.steps_start = num_train_steps - max(round(fraction * num_train_steps), 1) + 1

    def final_step(self) -> int:
        """A run that had finished its decay does not train on."""
        return min(self.num_train_steps, self.window[1]) if self.window else self.num_train_steps

    def by_steps(self, state, step: int):
        """The state, with the decay begun if `step` is where the step count starts it."""
        if self.fraction and self.window is None and step >= self.steps_start:
            return self._begin(state, step, self.num_train_steps)
        return state

    def by_time(self, state, step: int, seconds: float, budget: TimeBudget, pace: float):
        """The state, with the decay begun at the next step if (1 - fraction) of the budget is spent: it ends where
        this part's `pace` (steps per second) projects the budget's end."""
        if self.fraction and self.window is None and budget.limited and seconds >= (1 - self.fraction) * budget.seconds:
            end = min(step + int(budget.left(seconds) * pace), self.num_train_steps)
            return self._begin(state, step + 1, end)
        return state

    def ends_at(self, step: int) -> bool:
        return bool(self.window) and step == self.window[1]

    def done(self, step: int, final_step: int) -> bool:
        """The decay has ended before the run's last step (a timed decay): the run stops here."""
        return bool(self.window) and self.window[1] <= step < final_step

    def before_step(self, loop, step: int) -> None:
        loop.state = self.by_steps(loop.state, step)

    def syncs(self, loop, step: int) -> bool:
        return self.ends_at(step)

    def stop_reason(self, loop, step: int) -> str | None:
        if not self.done(step, loop.final_step):
            return None
        reason = (f"the cooldown (optimizer.cooldown_fraction={self.fraction:g}) is done ({loop.clock.seconds:.0f}s of "
                  "training)")
        loop.progress.write(f"step {step}: {reason}")
        return reason

    def at_sync(self, loop, step: int) -> None:
        loop.state = self.by_time(loop.state, step, loop.clock.seconds, loop.budget, loop.pace(step))

    def _begin(self, state, start: int, end: int):
        state = state.replace(opt_state=optim.begin_cooldown(state.opt_state, start, end))
        self.window = start, end = optim.cooldown_steps(state.opt_state)  # as stored (end >= start)
        self.progress.write(f"cooldown: the learning rate decays linearly from step {start} to step {end}, which "
                            f"gets 1/{end - start + 1} of the schedule (optimizer.cooldown_fraction="
                            f"{self.fraction:g})")
        return state


class ReportMarks(Action):
    """train.report_minutes: at these training minutes also average, decode and score. The marks an earlier part of
    the run scored are in `reports`; a mark it passed without scoring (stopped in between) is scored at the first
    fetch of this part."""

    def __init__(self, marks: list[float], reports: dict[str, Any]):
        self.reports = reports
        self.marks = [m for m in marks if f"{m:g}" not in reports]

    def due(self, seconds: float) -> bool:
        return bool(self.marks) and seconds >= self.marks[0] * 60

    def record(self, seconds: float, report: dict[str, Any]) -> None:
        """One scoring serves every mark passed by now."""
        while self.due(seconds):
            self.reports[f"{self.marks.pop(0):g}"] = report

    def at_sync(self, loop, step: int) -> None:
        """A mark passed: save, then average, decode and score (not training time)."""
        if not self.due(loop.clock.seconds):
            return
        loop.save(step, force=True)
        with loop.clock.paused():
            loop.progress.write(f"step {step}: train.report_minutes mark reached after {loop.clock.seconds:.0f}s of "
                                "training")
            self.record(loop.clock.seconds, loop.score_final())
            loop.write_reports(self.reports)


class TimedCheckpoint(Action):
    """train.checkpoint_every_minutes: a save at the first fetch that many training minutes after the last save."""

    def __init__(self, minutes: float):
        self.seconds = minutes * 60

    def due(self, seconds: float, saved_at: float) -> bool:
        return bool(self.seconds) and seconds - saved_at >= self.seconds

    def at_sync(self, loop, step: int) -> None:
        if self.due(loop.clock.seconds, loop.saved_at):
            loop.save(step, force=True)


def _preemption_service() -> bool:
    """Whether JAX's preemption service runs here (jax.distributed initialized with it): it owns SIGTERM then."""
    from jax._src import distributed  # the public API has no query for it; the sync point raises without it
    return distributed.global_state.preemption_sync_manager is not None


class Stopped(SystemExit):
    """A stop signal where no step can finish first (start-up, compiling, the final evaluation), raised where the
    main thread is: the run commits what it was saving, frees its workdir, says what is kept and exits with
    EXIT_PREEMPTED (a SystemExit, so no `except Exception` on the way swallows it)."""

    def __init__(self, signal_name: str, phase: str):
        super().__init__(EXIT_PREEMPTED)
        self.signal_name, self.phase = signal_name, phase


class Preemption(Action):
    """SIGTERM or SIGINT, whenever they come in a run (Run installs the handlers at its start, removes them at its
    close). In the loop (phase "training") the current step finishes, the loop saves a checkpoint, waits for it to
    be committed and exits with EXIT_PREEMPTED. In start-up, compiling and the final evaluation (STOPPING_PHASES)
    the signal raises Stopped at once, and the run commits its pending save and exits with the same status; while
    it writes its scores ("finishing") the signal is noted and the run ends. A second signal exits at once (Orbax
    commits a checkpoint by renaming it whole, so an interrupted save leaves the previous one intact), unless it is
    the same signal within REPEAT_SECONDS: SLURM's --signal reaches every process of a job step, and a sweep
    forwards the same SIGTERM to its runs.

    With several processes under jax.distributed, JAX's preemption service owns SIGTERM (the cluster's notice) and
    agrees on one step for every host (multihost_utils.reached_preemption_sync_point); SIGINT is handed to it as a
    SIGTERM, only in the loop, and outside it a SIGTERM only records the notice (a host stopping alone outside the
    loop would leave the others waiting at a collective). Without that service (a single process) our own handler
    acts; several processes without it get no handler (each would stop at its own step)."""

    STOPPING_PHASES = ("start-up", "compiling", "the final evaluation")
    REPEAT_SECONDS = 2.0  # the same signal again this soon is the same stop, not a second one

    def __init__(self):
        self.received: str | None = None
        self.received_at = 0.0  # time.monotonic() of the first signal
        self.service = jax.process_count() > 1 and _preemption_service()
        self.previous: dict[int, Any] = {}
        self.stops = False  # whether the loop stops after the step just asked about (syncs)
        self.phase = "training"  # what the run is doing: where a signal stops it (STOPPING_PHASES) or is noted

    def install(self) -> bool:
        """Our handlers in place of the current ones (once); whether this call installed them."""
        if self.previous:
            return False
        if jax.process_count() > 1 and not self.service:
            # Each host would stop at its own step and the others would wait at the next collective for ever.
            log.warning("several processes without JAX's preemption service (jax_enable_preemption_service): "
                        "SIGTERM and SIGINT stop the run without a checkpoint")
        elif threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
            for signum in (signal.SIGINT,) if self.service else (signal.SIGTERM, signal.SIGINT):
                self.previous[signum] = signal.signal(signum, self._handle)
            return True
        elif jax.process_count() == 1:
            log.warning("training outside the main thread: SIGTERM and SIGINT stop the run without a checkpoint")
        return False

    def uninstall(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def __enter__(self) -> "Preemption":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    @contextlib.contextmanager
    def during(self, phase: str, then: str | None = None):
        """Inside, the run is in `phase` (after it, in `then`, by default the phase before); the handlers are
        installed for it if they were not."""
        installed, previous, self.phase = self.install(), self.phase, phase
        try:
            yield self
        finally:
            self.phase = then or previous
            if installed:
                self.uninstall()

    def enter(self, phase: str) -> None:
        """The run is now in `phase`; a signal noted before it stops the run here if the phase stops at one."""
        self.phase = phase
        if phase in self.STOPPING_PHASES and self.received is not None and not self.service:
            raise Stopped(self.received, phase)

    NOTED = {"training": "finishing this step, then saving a checkpoint and exiting",
             "saving": "committing the final checkpoint, then stopping",
             "finishing": "the run is writing its scores and ends in a moment"}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received == name and time.monotonic() - self.received_at < self.REPEAT_SECONDS:
            return  # one stop delivered twice: a scheduler signals every process of the job, and a sweep forwards it
        if self.received is not None:
            os.write(2, f"{name} again: exiting at once; the last committed checkpoint is kept\n".encode())
            os._exit(128 + signum)
        self.received, self.received_at = name, time.monotonic()
        if self.phase in self.STOPPING_PHASES and not self.service:
            os.write(2, f"{name} during {self.phase}: stopping ({name} again: exit at once)\n".encode())
            raise Stopped(name, self.phase)
        os.write(2, f"{name}: {self.NOTED.get(self.phase, self.NOTED['training'])} ({name} again: exit at "
                    f"once)\n".encode())
        if self.service:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's service agrees the step with the other hosts

    def reached(self, step: int) -> bool:
        """Whether the loop stops after `step` (every host gets the same answer for the same step)."""
        if self.service:
            from jax.experimental import multihost_utils
            if multihost_utils.reached_preemption_sync_point(step):
                self.received = self.received or "a preemption notice"
                return True
            return False
        return self.received is not None

    def syncs(self, loop, step: int) -> bool:
        """Asked at every step: with JAX's service every host must reach each step's sync point."""
        self.stops = self.reached(step)
        return self.stops

    def stop_reason(self, loop, step: int) -> str | None:
        return f"preempted by {self.received}" if self.stops else None


class Profile(Action):
    """train.profile_steps="N-M": a profiler trace of steps N to M (inclusive) in `directory`, which TensorBoard's
    profile plugin and Perfetto read. The trace stops after step M has finished on the devices: one host sync,
    only there."""

    def __init__(self, steps: tuple[int, int] | None, directory: str, start_step: int):
        self.steps, self.directory, self.active = steps, directory, False
        if steps and steps[0] <= start_step:  # a resumed run past its first step does not trace a partial range
            self.steps = None

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0]:
            jax.profiler.start_trace(self.directory)
            self.active = True

    def after(self, step: int, state: Any) -> None:
        if self.active and step == self.steps[1]:
            jax.block_until_ready(state)
            self.stop()
            log.info("profiled steps %d-%d into %s (tensorboard --logdir=%s, or ui.perfetto.dev)", *self.steps,
                     self.directory, self.directory)

    def before_step(self, loop, step: int) -> None:
        self.before(step)

    def after_step(self, loop, step: int) -> None:
        self.after(step, loop.state)

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
