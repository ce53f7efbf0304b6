"""Fine-tuning: a run that starts from another run's parameters and vocabulary (train.init_from), with a fresh
optimizer, schedule and data position; and minimum risk training from such a start (train.objective=risk): its
resume is bitwise."""

import json
import os

import jax
import numpy as np
import pytest
from tiny import make_tiny_config, tree_digest
from transformer import errors, trainer
from transformer.restore import InitFrom, restore

RISK = {"train.objective": "risk", "data.pack": False, "train.risk_candidates": 4, "decode.bleu_splits": ""}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny run trained by likelihood for 30 steps on the built-in corpus: checkpoints at 27 and 30 (of every 3)."""
    workdir = tmp_path_factory.mktemp("source") / "mle"
    trainer.Run(make_tiny_config(**{"decode.bleu_splits": "", "train.num_train_steps": 30}), str(workdir)).train()
    return workdir


def leaves_equal(a, b) -> bool:
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_a_warm_start_takes_the_parameters_and_vocabulary_and_starts_the_rest_afresh(source, tmp_path):
    config = make_tiny_config(**{"decode.bleu_splits": "", "train.num_train_steps": 2, "data.builtin_seed": 1,
                                 "model.dropout_rate": 0.1, "train.init_from": f"{source}:27"})
    run = trainer.Run(config, str(tmp_path / "tuned"))
    try:
        assert int(run.state.step) == 0 and run.data_state is None  # the schedule and the data from their start
        assert leaves_equal(jax.device_get(run.state.params), restore(str(source), 27).params)
        assert not leaves_equal(jax.device_get(run.state.params), restore(str(source), 30).params)
        moments = [x for x in jax.tree.leaves(jax.device_get(run.state.opt_state)) if np.ndim(x) > 0]
        assert moments and all(not np.any(x) for x in moments)  # Adam's moments: zero, not the source's
    finally:
        run.close()
    trainer.Run(config, str(tmp_path / "tuned")).train()
    tuned = tmp_path / "tuned"
    assert (tuned / "vocab.model").read_bytes() == (source / "vocab.model").read_bytes()
    record = json.loads((tuned / "run.json").read_text())
    assert record["init_from"]["workdir"] == str(source) and record["init_from"]["step"] == 27
    assert record["init_from"]["vocabulary"] == record["vocabulary"]
    assert restore(str(tuned)).step == 2
    # Started again, the run resumes its own checkpoint (step 2: done), not the source's parameters.
    again = trainer.Run(config, str(tuned))
    try:
        assert int(again.state.step) == 2
        assert leaves_equal(jax.device_get(again.state.params), restore(str(tuned)).params)
    finally:
        again.close()


@pytest.mark.parametrize("overrides, error, message", [
    ({"model.mlp_dim": 48}, errors.ConfigError, r"model.mlp_dim: 64 there, 48 here"),
    ({"model.layer_norm": "pre"}, errors.ConfigError, r"model.layer_norm: 'post' there, 'pre' here"),
    ({"train.init_from": "{source}-missing"}, FileNotFoundError, r"mle-missing/config.json not found"),
    ({"train.init_from": "{source}:7"}, FileNotFoundError, r"holds no checkpoint of step 7; its checkpoints: \[.*27, 30\]"),
    ({"train.init_from": "{source}:best"}, FileNotFoundError, r"holds no best checkpoint; its checkpoints: none"),
    ({"train.init_from": "{source}:avg9"}, FileNotFoundError, r"holds no 9 checkpoints to average"),
    ({"data.vocab_path": "{other}"}, errors.ConfigError, r"keeps that run's vocabulary.*leave data.vocab_path empty"),
])
def test_a_warm_start_from_another_shape_or_vocabulary_is_refused_before_any_write(source, tmp_path, overrides,
                                                                                   error, message):
    other = tmp_path / "other.model"
    other.write_bytes((source / "vocab.model").read_bytes() + b"x")
    values = {"train.init_from": str(source), **overrides}
    values = {key: value.format(source=source, other=other) if isinstance(value, str) else value
              for key, value in values.items()}
    before = tree_digest(source)
    with pytest.raises(error, match=message):
        trainer.Run(make_tiny_config(**values), str(tmp_path / "tuned")).train()
    assert not (tmp_path / "tuned").exists() or not os.listdir(tmp_path / "tuned")
    assert tree_digest(source) == before


def test_init_from_names_a_step_the_best_or_an_average_and_keeps_colons_of_a_path():
    assert InitFrom.parse("runs/a") == InitFrom("runs/a")
    assert InitFrom.parse("runs/a:120") == InitFrom("runs/a", step=120)
    assert InitFrom.parse("gs://bucket/a:best") == InitFrom("gs://bucket/a", best=True)
    assert InitFrom.parse("gs://bucket/a") == InitFrom("gs://bucket/a")
    assert InitFrom.parse("runs/a:avg5") == InitFrom("runs/a", average_last=5)
    with pytest.raises(errors.ConfigError, match="avgK needs K >= 1"):
        InitFrom.parse("runs/a:avg0")


@pytest.mark.parametrize("overrides, message", [
    ({"data.pack": True}, "set data.pack=false"),
    ({"train.risk_weight": 1.5}, r"train.risk_weight=1.5 must be in \[0, 1\]"),
    ({"train.risk_candidates": 1}, "train.risk_candidates=1 must be >= 2"),
    ({"train.objective": "rl"}, r"train.objective='rl' is not one of \('mle', 'risk'\)"),
])
def test_bad_risk_settings_are_refused_naming_the_setting(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        trainer.Run(make_tiny_config(**{**RISK, **overrides}), str(tmp_path / "w"))
    assert not (tmp_path / "w").exists() or not os.listdir(tmp_path / "w")


@pytest.mark.slow
def test_a_resumed_risk_fine_tune_ends_with_the_same_parameters_bitwise(source, tmp_path):
    overrides = {**RISK, "train.init_from": str(source), "train.num_train_steps": 4}
    trainer.Run(make_tiny_config(**overrides), str(tmp_path / "straight")).train()
    trainer.Run(make_tiny_config(**{**overrides, "train.num_train_steps": 2}), str(tmp_path / "resumed")).train()
    run = trainer.Run(make_tiny_config(**overrides), str(tmp_path / "resumed"))
    assert int(run.state.step) == 2
    run.train()
    straight, resumed = restore(str(tmp_path / "straight")), restore(str(tmp_path / "resumed"))
    assert straight.step == resumed.step == 4
    assert leaves_equal(straight.params, resumed.params)
    assert not leaves_equal(straight.params, restore(str(source)).params)  # it trained
    records = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["split"] == "train"]
    assert train_records and all(0 <= r["reward"] <= 1 and 0 <= r["risk"] <= 1 for r in train_records)


def test_the_finetune_config_is_the_source_runs_settings_with_a_warm_start_from_it(source, tmp_path):
    """configs/finetune.py:WORKDIR: that run's model, data and decoding settings, train.init_from=WORKDIR; the warm
    start's checks pass on it, and a changed model setting is still refused."""
    from transformer import config_files
    from transformer.restore import load_workdir_config, warm_start_config
    path = config_files.find("configs/finetune.py")
    config = config_files.plain(load_config_file(path, f"{source}:27"))
    saved = load_workdir_config(str(source))
    assert config["model"] == saved["model"] and config["train"]["init_from"] == f"{source}:27"
    assert {key: value for key, value in config["data"].items() if key != "vocab_path"} == {
        key: value for key, value in saved["data"].items() if key != "vocab_path"}
    assert warm_start_config(config)["data"]["vocab_path"] == os.path.join(str(source), "vocab.model")
    config["model"]["mlp_dim"] += 16
    with pytest.raises(errors.ConfigError, match="model.mlp_dim"):
        warm_start_config(config)


def load_config_file(path, argument):
    import importlib.util
    spec = importlib.util.spec_from_file_location("finetune_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(argument)
