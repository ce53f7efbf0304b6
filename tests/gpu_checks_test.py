"""scripts/gpu_checks.sh, the prepared GPU checks, runs end to end at toy sizes on any machine
(GPU_CHECKS_SMOKE=1): its flags, configs and output stay in step with scripts/benchmark.py. Slow: about a minute."""

import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_gpu_checks_script_runs_at_toy_sizes(tmp_path):
    env = {**os.environ, "GPU_CHECKS_SMOKE": "1", "OUT": str(tmp_path)}
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_checks.sh")], env=env, timeout=600,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = (tmp_path / "gpu_checks.log").read_text()
    # devices, tests, one train step, decode in float32 and bfloat16 weights, MBR's draw, the four variants' train
    # steps, the hybrid's decode, decode cost
    assert log.count("== rc 0") == 12 and "== rc 1" not in log, log
    results = [json.loads(line) for line in (tmp_path / "gpu_checks.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in results] == ["train", "decode", "decode", "decode", "train", "train", "train", "train",
                                            "decode"]
    assert [r["weights"] for r in results[1:3]] == ["float32", "bfloat16"]
    assert (results[1]["candidates"], results[3]["candidates"], results[3]["batch"]) == (0, 16, 2)
    results = results[:2] + results[4:]  # the rest as before the bfloat16 decode and MBR's draw
    assert results[0]["model"]["dtype"] == "bfloat16" and results[0]["model"]["emb_dim"] == 64
    variants = [(r["model"]["family"], r["model"]["num_encoder_layers"], r["model"]["num_decoder_layers"],
                 r["model"]["num_experts"]) for r in results[2:6]]
    assert variants == [("decoder_only", 0, 2, 0), ("encoder_only", 1, 0, 0), ("encoder_decoder", 1, 1, 8),
                        ("encoder_decoder", 1, 1, 0)]
    assert results[5]["model"]["decoder_attention"] == results[6]["model"]["decoder_attention"] == "ssm,ssm,dense"
    costs = [json.loads(line) for line in (tmp_path / "decode_cost" / "cost.jsonl").read_text().splitlines()]
    assert {(r["kind"], r["length"]) for r in costs} == {("dense", 8), ("dense", 16), ("ssm", 8), ("ssm", 16)}
