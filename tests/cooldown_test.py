"""optimizer.cooldown_fraction in the trainer: the learning rate decays linearly to 0 over the last part of a
run of fixed length, or of a time budget (decided on the training clock, here a fake one, so that the test
does not depend on the machine's speed); and that clock itself: evaluation and scoring are not training time."""

import os
import types

import numpy as np
import pytest
from tiny import make_tiny_config, metric_records
from transformer import optim, trainer
from transformer.settings import check_resume_config


def learning_rates(workdir) -> dict[int, float]:
    records = metric_records(workdir)
    return {r["step"]: r["learning_rate"] for r in records if r["split"] == "train"}


def schedule_of(config):
    return optim.rsqrt_schedule(config.optimizer.learning_rate_scale, config.model.emb_dim,
                                config.optimizer.warmup_steps)


def test_a_run_of_fixed_length_cools_down_over_its_last_steps(tmp_path):
    config = make_tiny_config(**{"optimizer.cooldown_fraction": 0.5, "train.log_every_steps": 1,
                                 "train.eval_every_steps": 0, "decode.bleu_splits": ""})
    trainer.Run(config, str(tmp_path)).train()  # 6 steps: the last 3 decay, at 3/3, 2/3, 1/3 of the schedule
    schedule = schedule_of(config)
    expected = {step: float(schedule(step - 1)) * factor
                for step, factor in zip(range(1, 7), [1, 1, 1, 1, 2 / 3, 1 / 3])}
    rates = learning_rates(tmp_path)
    assert rates.keys() == expected.keys()
    np.testing.assert_allclose([rates[s] for s in expected], list(expected.values()), rtol=1e-5)
    assert optim.cooldown_steps(trainer.Run(config, str(tmp_path)).state.opt_state) == (4, 6)  # checkpointed


class FakeClock:
    """perf_counter for the trainer only: each reading is half a second after the previous one."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 0.5
        return self.now


def test_a_time_budget_cools_down_from_its_last_fraction_to_a_projected_last_step(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(perf_counter=FakeClock().perf_counter))
    config = make_tiny_config(**{"optimizer.cooldown_fraction": 0.5, "train.max_train_minutes": 1.0,
                                 "train.num_train_steps": 1000, "train.log_every_steps": 1,
                                 "train.eval_every_steps": 0, "train.checkpoint_every_steps": 1000,
                                 "decode.bleu_splits": ""})
    result = trainer.Run(config, str(tmp_path)).train()
    # The clock runs at a steady pace: the cooldown begins once 30 s are spent, half-way, set to end where the
    # remaining 30 s are projected to run out; the run stops there or at the budget, whichever comes first.
    resumed = trainer.Run(config, str(tmp_path))  # the window is read back from the checkpoint's optimizer state
    start, end = optim.cooldown_steps(resumed.state.opt_state)
    total = result["step"]
    assert total >= 20 and abs(start - total / 2) <= 3 and abs(end - total) <= 2, (start, end, total)
    assert result["train_seconds"] <= 60  # the budget is checked at the step it is projected to run out
    assert total == end or (total < end and result["train_seconds"] > 30 - 2)  # within a step or two of it
    rates, schedule = learning_rates(tmp_path), schedule_of(config)
    factor = lambda step: min((end - step + 1) / (end - start + 1), 1.0)  # noqa: E731
    np.testing.assert_allclose([rates[s] for s in sorted(rates)],
                               [float(schedule(s - 1)) * factor(s) for s in sorted(rates)], rtol=1e-5)
    assert rates[result["step"]] < rates[start - 1] / 5  # near 0 by the end
    # A run that has finished its decay does not train on when resumed with a larger budget.
    config.train.max_train_minutes = 1.0
    again = trainer.Run(config, str(tmp_path)).train()
    assert again["step"] == end and max(learning_rates(tmp_path)) == max(rates)


def test_a_saved_config_without_a_key_resumes_with_its_default():
    saved = make_tiny_config()
    del saved.optimizer["cooldown_fraction"]  # the config.json of a run whose config was given in part
    check_resume_config(saved, make_tiny_config())
    with pytest.raises(ValueError, match="optimizer.cooldown_fraction"):
        check_resume_config(saved, make_tiny_config(**{"optimizer.cooldown_fraction": 0.5}))


@pytest.mark.parametrize("fraction", [-0.1, 1.0])
def test_a_bad_cooldown_fraction_names_the_key(tmp_path, fraction):
    config = make_tiny_config(**{"optimizer.cooldown_fraction": fraction})
    with pytest.raises(ValueError, match="optimizer.cooldown_fraction"):
        trainer.Run(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_evaluation_and_report_scoring_are_not_training_time(tmp_path, monkeypatch):
    """Budgets, report marks, tokens/s and time-to-BLEU curves all read train_seconds: the time spent evaluating
    the dev loss or scoring a report mark (here 100 s of the fake clock each) must stay out of it."""
    clock = FakeClock()
    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    report_loss = trainer.Loop.report_loss

    def slow_report_loss(self, *args):
        clock.now += 100.0
        return report_loss(self, *args)

    def slow_scoring(self, *args):
        clock.now += 100.0
        return {"averaged_steps": [], "bleu": {}}
    monkeypatch.setattr(trainer.Loop, "report_loss", slow_report_loss)
    monkeypatch.setattr(trainer.Loop, "score_final", slow_scoring)
    config = make_tiny_config(**{"train.log_every_steps": 1, "train.eval_every_steps": 2,
                                 "train.report_minutes": "0.02", "decode.bleu_splits": "valid"})
    result = trainer.Run(config, str(tmp_path)).train()
    assert result["step"] == 6 and list(result["reports"]) == ["0.02"]
    # Each of the 6 steps reads the clock a few times (0.5 s each); two evaluations and a report took 300 s.
    assert 0 < result["train_seconds"] < 30, result["train_seconds"]
    records = metric_records(tmp_path)
    assert [r["step"] for r in records if r["split"] == "valid"] == [2, 4, 6]
    assert max(r["train_seconds"] for r in records if r["split"] == "train") < 30


def test_checkpoints_by_time_save_at_the_first_log_step_past_each_interval(tmp_path, monkeypatch):
    """train.checkpoint_every_minutes on the training clock (fake: each reading 0.5 s after the last): with
    steps every 12 and logs every 2, the saves in between come from the clock alone, and averaging sees them."""
    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(perf_counter=FakeClock().perf_counter))
    config = make_tiny_config(**{"train.num_train_steps": 12, "train.log_every_steps": 2,
                                 "train.eval_every_steps": 0, "train.checkpoint_every_steps": 12,
                                 "train.keep_checkpoints": 10, "train.checkpoint_every_minutes": 0.1,
                                 "decode.average_last": 3, "decode.bleu_splits": ""})
    run = trainer.Run(config, str(tmp_path))
    run.train()
    saved = run.checkpoints.states.all_steps()
    records = {r["step"]: r["train_seconds"] for r in metric_records(tmp_path) if r["split"] == "train"}
    # Expected from the logged clock: a save at each log step 6 s (0.1 minutes) or more after the last save.
    expected, last = [], 0.0
    for step in sorted(records):
        if step < 12 and records[step] - last >= 6:
            expected.append(step)
            last = records[step]
    assert expected and saved == expected + [12], (saved, records)
    assert sorted(int(name) for name in os.listdir(tmp_path / "params")) == saved[-3:]  # the snapshots averaging reads
