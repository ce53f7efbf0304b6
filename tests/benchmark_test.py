"""scripts/benchmark.py --mode=train as a user runs it, at toy sizes: the JSONL line holds what the table
prints, and its rates are the batch's tokens and the analytic FLOPs over the median step."""

import json
import os
import re
import subprocess
import sys

import numpy as np

from transformer import throughput
from transformer.model import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_train_benchmark_reports_median_step_tokens_per_second_and_mfu(tmp_path):
    output = tmp_path / "bench.jsonl"
    model = {"emb_dim": 32, "num_heads": 4, "mlp_dim": 64, "num_encoder_layers": 1, "num_decoder_layers": 2}
    command = [sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"), "--mode=train", "--hugepages=false",
               "--config=configs/multi30k.py",  # a config that reads a local folder, given none: no data is read
               "--batch=4", "--source_length=10", "--target_length=6", "--vocab_size=64", "--steps=3", "--warmup=1",
               "--peak_size=256", f"--output={output}", *[f"--config.model.{k}={v}" for k, v in model.items()]]
    env = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = output.read_text().splitlines()
    bench = json.loads(line)
    assert bench["glibc_tunables"] == ""  # --hugepages=false: measured without re-executing under huge pages
    assert bench["mode"] == "train" and bench["steps"] == 3 and bench["mesh"] == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
    median = bench["median_step_seconds"]
    assert bench["min_step_seconds"] <= median <= bench["max_step_seconds"] and bench["compile_seconds"] > 0
    # The synthetic batch has no padding: 4 x 6 target and 4 x 10 source tokens a step.
    np.testing.assert_allclose(bench["target_tokens_per_second"], 4 * 6 / median, rtol=1e-9)
    np.testing.assert_allclose(bench["tokens_per_second"], 4 * (10 + 6) / median, rtol=1e-9)
    config = ModelConfig(vocab_size=64, **model)
    assert bench["model_flops_per_step"] == throughput.model_flops_of_shape(config, 4, 10, 6)
    np.testing.assert_allclose(bench["mfu"], bench["model_flops_per_step"] / median / bench["peak_flops"], rtol=1e-9)
    assert bench["peak_from"] == "float32 256^3 matmul, median of 5" and np.isfinite(bench["final_loss"])
    assert bench["memory"]["total_per_device_bytes"] > 0
    assert re.search(rf"\nMFU +{bench['mfu']:.3f}\n", result.stdout), result.stdout  # the printed table
