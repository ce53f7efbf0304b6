"""The training loop's periodic actions (transformer/loop.py), each on its own trigger; the non-finite flag of the
train step under both policies; and a run stopped by a non-finite step, which names it and saves nothing after it."""

import functools
import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import make_tiny_config, metric_records
from transformer import loop, optim, trainer
from transformer.model import ModelConfig
from transformer.optim import OptimizerConfig, make_optimizer
from transformer.steps import TrainState, train_step
from transformer.plan import create_train_state, model_graphdef



class FakeTime:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_every_is_due_at_multiples_and_never_when_zero():
    assert [s for s in range(1, 10) if loop.Every(3)(s)] == [3, 6, 9]
    assert not any(loop.Every(0)(s) for s in range(1, 10))


def test_the_clock_counts_training_time_but_not_what_runs_paused():
    now = FakeTime()
    clock = loop.Clock(100.0, timed=False, now=now)  # 100 s from an earlier part of the run
    now.now = 5.0
    with clock.paused():
        now.now = 65.0  # a minute of evaluation
    now.now = 70.0
    assert clock.tick() == 70.0 - 60.0 and clock.seconds == 110.0


def window_metrics(loss, grad_norm, nonfinite, tokens=10.0):
    return {"loss": np.float32(loss), "nll": np.float32(loss), "correct": np.float32(1), "denominator": np.float32(tokens),
            "source_tokens": np.float32(tokens), "grad_norm": np.float32(grad_norm), "nonfinite": np.int32(nonfinite)}


def test_a_non_finite_step_stops_the_run_naming_it_and_the_last_checkpoint():
    window = loop.MetricsWindow(first_step=11, policy="stop")
    for values in [(20.0, 1.0, 0), (20.0, np.inf, 1), (np.nan, np.nan, 1)]:
        window.add(window_metrics(*values))
    with pytest.raises(loop.NonFiniteError, match=r"non-finite training gradient norm inf at step 12 .*last good "
                                                  r"checkpoint: step 10 in /w/checkpoints"):
        window.fetch(last_checkpoint="step 10 in /w/checkpoints")


def test_skipped_steps_are_counted_and_left_out_of_the_averages():
    window = loop.MetricsWindow(first_step=1, policy="skip")
    for values in [(20.0, 1.0, 0), (np.nan, np.nan, 1), (40.0, 3.0, 0)]:
        window.add(window_metrics(*values))
    summary = window.fetch(last_checkpoint="none")
    assert summary["skipped_updates"] == 1 and window.skipped == 1
    assert summary["loss"] == 3.0 and summary["grad_norm"] == 2.0  # (20 + 40) / 20 tokens; mean of 1 and 3
    window.add(window_metrics(10.0, 1.0, 0))
    assert window.fetch(last_checkpoint="none")["skipped_updates"] == 0 and window.first_step == 5


def test_skipping_past_the_limit_stops_counting_the_earlier_parts_of_the_run():
    window = loop.MetricsWindow(first_step=21, policy="skip", max_skipped=3, skipped=2)  # 2 before a resume
    window.add(window_metrics(np.nan, np.nan, 1))
    assert window.fetch(last_checkpoint="none")["skipped_updates"] == 1 and window.skipped == 3  # at the limit
    for values in [(20.0, 1.0, 0), (np.nan, np.nan, 1)]:
        window.add(window_metrics(*values))
    with pytest.raises(loop.NonFiniteError, match=r"skipped 4 non-finite updates by step 23, more than "
                                                  r"train.max_skipped_updates=3 \(first in this window: step 23\);"
                                                  r".*last good checkpoint: step 20"):
        window.fetch(last_checkpoint="step 20")


def test_the_totals_of_a_resumed_run_count_its_earlier_parts(tmp_path):
    records = [{"split": "train", "step": 10, "train_seconds": 5.0, "skipped_updates": 2, "steps_per_second": 2.0},
               {"split": "valid", "step": 10, "loss": 3.0},
               {"split": "train", "step": 20, "train_seconds": 9.0, "skipped_updates": 1, "steps_per_second": 2.5},
               {"split": "train", "step": 30, "train_seconds": 14.0, "skipped_updates": 4}]  # after the resumed step
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert trainer.previous_train_totals(str(tmp_path), 20) == (9.0, 3, 2.5)
    assert trainer.previous_train_totals(str(tmp_path), 0) == (0.0, 0, 0.0)


def test_the_budget_asks_for_a_fetch_where_it_runs_out_and_says_when_it_is_spent():
    budget = loop.TimeBudget(minutes=1.0, log_every_steps=10)
    budget.update(step=10, steps=10, seconds_before=0.0, seconds_now=20.0)  # 2 s a step: 20 steps left
    assert budget.check_step is None and not budget.spent()
    budget.update(step=20, steps=10, seconds_before=20.0, seconds_now=50.0)  # 3 s a step: 3 steps left
    assert budget.check_step == 23 and not budget.spent() and budget.left(50.0) == 10.0
    budget.update(step=23, steps=3, seconds_before=50.0, seconds_now=59.0)  # 3 s a step, 1 s left
    assert budget.spent()
    assert not loop.TimeBudget(minutes=0.0, log_every_steps=10).limited


def tiny_state(cooldown_fraction):
    optimizer, _ = make_optimizer(OptimizerConfig(cooldown_fraction=cooldown_fraction), 8)
    params = {"w": jnp.zeros(3)}
    return TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params), rng=jax.random.key(0))


class Lines:
    def __init__(self):
        self.lines = []

    def write(self, line):
        self.lines.append(line)


def test_the_cooldown_begins_by_steps_or_by_time_and_a_finished_one_ends_the_run():
    progress = Lines()
    cooldown = loop.Cooldown(0.25, num_train_steps=100, opt_state=tiny_state(0.25).opt_state, progress=progress)
    state = tiny_state(0.25)
    assert cooldown.by_steps(state, 75) is state and cooldown.window is None
    state = cooldown.by_steps(state, 76)
    assert cooldown.window == (76, 100) and optim.cooldown_steps(state.opt_state) == (76, 100)
    assert "from step 76 to step 100" in progress.lines[-1]
    assert cooldown.by_steps(state, 90) is state  # begun once

    budget = loop.TimeBudget(minutes=10.0, log_every_steps=10)
    timed = loop.Cooldown(0.25, num_train_steps=10_000, opt_state=tiny_state(0.25).opt_state, progress=progress)
    state = tiny_state(0.25)
    assert timed.by_time(state, 40, seconds=449.0, budget=budget, pace=0.5) is state  # before 3/4 of 600 s
    state = timed.by_time(state, 40, seconds=450.0, budget=budget, pace=0.5)  # 150 s left at 0.5 steps/s: 75 steps
    assert timed.window == (41, 115) and timed.ends_at(115) and not timed.done(114, final_step=10_000)
    assert timed.done(115, final_step=10_000) and not timed.done(115, final_step=115)
    # Restored with a finished decay, the run's last step is the decay's end.
    assert loop.Cooldown(0.25, 10_000, state.opt_state, progress).final_step() == 115


def test_report_marks_skip_the_scored_ones_and_one_scoring_serves_every_mark_passed():
    marks = loop.ReportMarks([10.0, 20.0, 30.0], reports={"10": {"bleu": 1}})
    assert marks.marks == [20.0, 30.0] and not marks.due(1199.0) and marks.due(1200.0)
    marks.record(1900.0, {"bleu": 2})
    assert marks.reports == {"10": {"bleu": 1}, "20": {"bleu": 2}, "30": {"bleu": 2}} and not marks.due(1e9)


def test_a_timed_checkpoint_is_due_an_interval_after_the_last_save():
    timed = loop.TimedCheckpoint(minutes=10.0)
    assert not timed.due(seconds=1199.0, saved_at=600.0) and timed.due(seconds=1200.0, saved_at=600.0)
    assert not loop.TimedCheckpoint(minutes=0.0).due(seconds=1e9, saved_at=0.0)


class FakeLoop:
    """What the actions act on (trainer.Loop's services), recording what they ask of it."""

    def __init__(self, state, seconds=0.0, final_step=100):
        self.state, self.final_step, self.saved_at = state, final_step, 0.0
        self.now = FakeTime()
        self.clock = loop.Clock(seconds, timed=False, now=self.now)
        self.budget = loop.TimeBudget(minutes=0.0, log_every_steps=10)
        self.progress, self.saves, self.written = Lines(), [], []

    def save(self, step, force=False):
        self.saves.append((step, force))

    def pace(self, step):
        return 1.0

    def score_final(self):
        self.now.now += 50.0  # scoring takes a while: off the training clock
        return {"bleu": 1.0}

    def write_reports(self, reports):
        self.written.append(dict(reports))


def test_the_actions_act_through_the_loop_at_their_hooks():
    part = FakeLoop(tiny_state(0.25))
    checkpoint, log_every = loop.Checkpoint(3), loop.Every(2, syncs=True)
    assert [s for s in range(1, 7) if checkpoint.syncs(part, s)] == [3, 6]
    assert [s for s in range(1, 7) if log_every.syncs(part, s)] == [2, 4, 6]
    checkpoint.end_of_step(part, 4)
    assert part.saves == [(4, False)]  # every step asks: the checkpointer keeps to its interval
    evaluated = []
    loop.Every(3, lambda loop_, step: evaluated.append(step)).off_the_clock(part, 3)
    assert evaluated == [3] and not loop.Every(3, evaluated.append).syncs(part, 3)

    cooldown = loop.Cooldown(0.25, num_train_steps=100, opt_state=part.state.opt_state, progress=part.progress)
    cooldown.before_step(part, 76)  # begun by the step count, in the loop's state
    assert optim.cooldown_steps(part.state.opt_state) == (76, 100) and cooldown.syncs(part, 100)
    assert cooldown.stop_reason(part, 99) is None

    budget = loop.TimeBudget(minutes=1.0, log_every_steps=10)
    budget.update(step=20, steps=10, seconds_before=0.0, seconds_now=59.5)  # under a step of budget left
    assert budget.stop_reason(part, 20).startswith("the time budget of train.max_train_minutes=1 is spent")
    assert part.progress.lines[-1].startswith("step 20: the time budget")

    timed = loop.TimedCheckpoint(minutes=1.0)
    part.clock.seconds, part.saved_at = 90.0, 20.0
    timed.at_sync(part, 30)
    assert part.saves[-1] == (30, True)

    marks = loop.ReportMarks([1.0], reports={})
    marks.at_sync(part, 30)  # 90 s of training: the 1-minute mark is passed
    assert part.saves[-1] == (30, True) and part.written == [{"1": {"bleu": 1.0}}]
    assert part.clock.tick() == 0.0  # the scoring's 50 s are not training time

    preemption = loop.Preemption()
    assert not preemption.syncs(part, 5) and preemption.stop_reason(part, 5) is None
    preemption.received = "SIGTERM"
    assert preemption.syncs(part, 6) and preemption.stop_reason(part, 6) == "preempted by SIGTERM"


def test_a_stop_signal_is_noticed_at_the_next_step_and_the_handlers_are_put_back():
    before = signal.getsignal(signal.SIGTERM)
    with loop.Preemption() as preemption:
        assert not preemption.reached(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.reached(2) and preemption.received == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def stop_signals(*steps: str) -> subprocess.CompletedProcess:
    """A process under loop.Preemption that runs `steps` (lines of Python: kills, sleeps), prints what it noted
    and then waits."""
    code = "\n".join(["import os, signal, time", "from transformer import loop", "with loop.Preemption() as p:",
                      *(f"    {step}" for step in steps), "    print('noted', p.received, flush=True)",
                      "    time.sleep(30)"])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_second_signal_exits_at_once_and_the_same_one_delivered_twice_is_one_stop():
    other = stop_signals("os.kill(os.getpid(), signal.SIGINT)", "os.kill(os.getpid(), signal.SIGTERM)")
    assert other.returncode == 128 + signal.SIGTERM, other.stderr
    assert "SIGTERM again: exiting at once" in other.stderr
    # SLURM's --signal reaches the run and the sweep that forwards it: the second copy is not a second stop.
    twice = stop_signals("os.kill(os.getpid(), signal.SIGTERM)", "os.kill(os.getpid(), signal.SIGTERM)",
                         "print('noted', p.received, flush=True)", "time.sleep(p.REPEAT_SECONDS + 0.5)",
                         "os.kill(os.getpid(), signal.SIGTERM)")
    assert twice.returncode == 128 + signal.SIGTERM, twice.stderr
    assert twice.stdout.splitlines() == ["noted SIGTERM"] and twice.stderr.count("again: exiting at once") == 1


@pytest.fixture(scope="module")
def poisoned():
    """A tiny model with one NaN in the embedding: its loss and gradients are not finite."""
    model_config = ModelConfig(vocab_size=30, emb_dim=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                               mlp_dim=32)
    optimizer, schedule = make_optimizer(OptimizerConfig(warmup_steps=10), 16)
    state = create_train_state(model_config, optimizer, seed=0)
    params = jax.tree.map(lambda x: x, state.params)
    name = next(key for key in params if "embed" in key.lower())
    params[name] = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan) if x.ndim else x, params[name])
    step = functools.partial(train_step, graphdef=model_graphdef(model_config), optimizer=optimizer,
                             schedule=schedule, label_smoothing=0.1)
    batch = {"inputs": jnp.array([[5, 6, 7, 1, 0, 0]]), "targets": jnp.array([[8, 9, 1, 0, 0, 0]])}
    return state.replace(params=params), step, batch


def test_the_train_step_flags_a_non_finite_update_and_skips_it_when_asked(poisoned):
    state, step, batch = poisoned
    applied, metrics = jax.jit(step)(state, batch)
    skipped, skipped_metrics = jax.jit(functools.partial(step, skip_nonfinite=True))(state, batch)
    assert int(metrics["nonfinite"]) == 1 and int(skipped_metrics["nonfinite"]) == 1
    assert int(skipped.step) == int(state.step) + 1  # the data and the step count advance
    for old, new in zip(jax.tree.leaves((state.params, state.opt_state)), jax.tree.leaves((skipped.params,
                                                                                        skipped.opt_state))):
        np.testing.assert_array_equal(old, new)  # NaN compares equal to NaN here: nothing was applied
    moments = [x for x in jax.tree.leaves(applied.opt_state) if x.ndim]
    assert any(not np.isfinite(np.asarray(x)).all() for x in moments)  # without skipping, Adam took the NaN in


def test_a_run_that_diverges_stops_at_the_step_naming_it_and_saves_nothing_after_it(tmp_path):
    config = make_tiny_config(**{"optimizer.learning_rate_scale": 1e9, "train.checkpoint_every_steps": 1,
                                 "train.log_every_steps": 3, "decode.bleu_splits": ""})
    run = trainer.Run(config, str(tmp_path))
    with pytest.raises(loop.NonFiniteError, match=r"non-finite training \w+.* at step (\d+)") as error:
        run.train()
    bad_step = int(str(error.value).split(" at step ")[1].split()[0])
    run.checkpoints.states.wait()
    assert 1 <= bad_step <= 3 and all(step < bad_step for step in run.checkpoints.states.all_steps())
    assert f"last good checkpoint: {'none' if bad_step == 1 else 'step'}" in str(error.value)


def test_under_skip_a_diverging_run_goes_on_and_logs_the_skipped_updates(tmp_path):
    config = make_tiny_config(**{"optimizer.learning_rate_scale": 1e9, "train.nonfinite": "skip",
                                 "train.eval_every_steps": 0, "decode.bleu_splits": ""})
    result = trainer.Run(config, str(tmp_path)).train()
    train_records = [r for r in metric_records(tmp_path) if r["split"] == "train"]
    skipped = sum(r["skipped_updates"] for r in train_records)
    assert train_records[-1]["step"] == 6 and skipped >= 1
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert result["skipped_updates"] == scores["skipped_updates"] == skipped  # the run's total, said at its end


def test_under_skip_a_run_that_skips_past_the_limit_stops_naming_it(tmp_path):
    config = make_tiny_config(**{"optimizer.learning_rate_scale": 1e9, "train.nonfinite": "skip",
                                 "train.max_skipped_updates": 3, "train.eval_every_steps": 0,
                                 "decode.bleu_splits": ""})
    with pytest.raises(loop.NonFiniteError, match=r"more than train.max_skipped_updates=3"):
        trainer.Run(config, str(tmp_path)).train()
    assert not (tmp_path / "scores.json").exists()
