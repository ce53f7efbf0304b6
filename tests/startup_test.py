"""Every shipped config starts where researchers launch it: the batch plan at 1-256 devices and 1-32 hosts
(pure arithmetic), and train.py's start-up path, up to the traced train step, on 8 and 64 fake CPU devices for
every config and the README's meshes (a subprocess each: XLA_FLAGS must be set before JAX starts)."""

import glob
import importlib
import json
import os
import subprocess
import sys

import jax
import pytest

from transformer import data, sharding
from transformer.plan import BatchShape, plan_batch, rows_multiple, startup_plan
from transformer.settings import Settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_CONFIGS = ("base", "big", "base_enfr", "big_enfr")


def settings_of(name, **mesh):
    config = importlib.import_module(f"configs.{name}").get_config()
    config.mesh.update({"data": 1, "fsdp": 1, "tensor": 1, **mesh})
    return Settings.from_config(config)


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_the_paper_configs_keep_about_25k_tokens_wherever_whole_rows_allow(name):
    settings = settings_of(name)
    asked = BatchShape(settings.data.rows_per_batch, settings.data.max_length)
    for devices in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for hosts in (1, 2, 4, 8, 16, 32):
            if hosts > devices:
                continue
            for mesh in (dict(data=-1), dict(data=1, fsdp=-1), dict(data=1, fsdp=-1, tensor=2)):
                if devices % (2 if "tensor" in mesh else 1):
                    continue
                shape = dict(zip(sharding.MESH_AXES,
                                 sharding.mesh_shape(settings_of(name, **mesh).mesh.sizes, devices)))
                ways = rows_multiple(settings_of(name, **mesh), shape, processes=hosts)
                batch, note = plan_batch(settings.data, ways)
                assert batch.rows % ways == 0 and batch.row_length == asked.row_length
                assert (note is None) == (batch == asked)  # a changed budget is always said
                if ways <= 32:  # 96 rows split whole: the paper's ~25k tokens a side, unchanged
                    assert batch == asked and 24_000 <= batch.tokens <= 26_000
                else:
                    assert f"training on {batch.rows} rows" in note and batch.rows == ways * -(-asked.rows // ways)


def test_the_batch_plan_takes_the_nearest_multiple_and_a_resume_keeps_its_recorded_batch():
    asked = data.DataConfig(tokens_per_batch=2048, max_length=64)  # 32 rows of 64
    assert plan_batch(asked, 8) == (BatchShape(32, 64), None)
    batch, note = plan_batch(asked, 12)
    assert batch == BatchShape(36, 64) and "+12.5%" in note  # 36 is nearer 32 than 24
    assert plan_batch(asked, 64)[0].rows == 64  # at least one row per way
    recorded = BatchShape(40, 64)
    assert plan_batch(asked, 8, recorded) == (recorded, None)
    with pytest.raises(ValueError, match=r"40 rows of 64 \(recorded in run.json\), which cannot be split 16 ways"):
        plan_batch(asked, 16, recorded)


def start_up(devices):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "startup_worker.py")], capture_output=True,
                            text=True, cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-5000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


# 64 in the default suite: it takes both branches of the batch plan (rows kept, rows rounded); 8 is slow.
@pytest.mark.parametrize("devices", [pytest.param(8, marks=pytest.mark.slow), 64])
def test_every_config_starts_on_the_readme_meshes(devices):
    records = start_up(devices)
    configs = {r["config"] for r in records}
    shipped = {os.path.basename(path)[:-3] for path in glob.glob(os.path.join(ROOT, "configs", "[!_]*.py"))}
    assert configs == shipped and len(records) == 3 * len(configs)
    for record in records:
        ways = record["mesh_shape"]["data"] * record["mesh_shape"]["fsdp"]
        assert record["rows"] % ways == 0 and record["local_rows"] * ways == record["rows"], record
        assert (record["note"] is None) == (record["rows"] == record["asked_rows"]), record
        assert record["params_split"] == (record["mesh"] != "data"), record  # fsdp / tensor split the parameters
        if record["mesh"] == "fsdp_tensor":
            assert record["step_traced"], record
    # The paper's ~25k tokens a side wherever the batch axes split the asked rows (on 8 devices: every mesh); where
    # they cannot (64 batch ways), the nearest multiple of the ways, said in the note.
    paper = [r for r in records if r["config"] in PAPER_CONFIGS]
    for record in paper:
        ways = record["mesh_shape"]["data"] * record["mesh_shape"]["fsdp"]
        if record["asked_rows"] % ways == 0:
            assert record["note"] is None and 24_000 <= record["tokens"] <= 26_000, record
        else:
            assert record["rows"] % ways == 0 and abs(record["rows"] - record["asked_rows"]) < ways, record
    assert devices != 8 or all(r["note"] is None for r in paper)


@pytest.mark.slow  # two real compiles at the paper's sizes: about a minute each on 2 cores
@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_the_paper_configs_compile_on_8_devices_with_the_batch_train_py_uses(name, tmp_path):
    output = tmp_path / "compile.jsonl"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"), "--compile_only",
                             f"--config=configs/{name}.py", "--config.mesh.data=1", "--config.mesh.fsdp=-1",
                             f"--output={output}"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(output.read_text().splitlines()[-1])
    assert (record["devices"], record["mesh"]["fsdp"]) == (8, 8)
    settings = settings_of(name)
    plan, _ = startup_plan(settings)  # this process's one device: the whole state
    # The batch train.py trains on: the config's own rows, since 8 batch ways split them, ~25k tokens a side.
    assert (record["batch"], record["source_length"]) == (settings.data.rows_per_batch, settings.data.max_length)
    assert 24_000 <= record["tokens_per_step"] <= 26_000 and record["batch_note"] == ""
    assert record["vocab_size"] == settings.data.vocab_size
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(plan.abstract_state(settings.seed)))
    # fsdp=8: each device's arguments are an eighth of the state plus its rows of the batch, well under a quarter.
    assert record["memory"]["argument_size_in_bytes"] < 0.25 * state_bytes
