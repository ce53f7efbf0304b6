"""scripts/benchmark.py --mode=train as a user runs it, at toy sizes: the JSONL line holds what the table
prints, and its rates are the batch's tokens and the analytic FLOPs over the median step."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from transformer import corpus, throughput
from transformer.model import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_decode_benchmark_finds_the_ssm_state_fixed_and_the_dense_cache_growing(tmp_path):
    """scripts/benchmark_attention.py --parts=decode: dense self-attention's cache grows by one key and value per
    layer, hypothesis and generated token; the state-space decoder's stays the same size at any length."""
    model = {"emb_dim": 32, "num_heads": 4, "mlp_dim": 64, "num_encoder_layers": 1, "num_decoder_layers": 2,
             "ssm_state": 8, "ssm_head_dim": 16}
    command = [sys.executable, os.path.join(ROOT, "scripts", "benchmark_attention.py"), "--parts=decode",
               "--kinds=dense,ssm", "--min_length=8", "--max_length=16", "--repeats=1", "--decode_hypotheses=2",
               f"--output_dir={tmp_path}", *[f"--config.model.{k}={v}" for k, v in model.items()]]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = {(r["kind"], r["length"]): r for r in map(json.loads, (tmp_path / "cost.jsonl").read_text().splitlines())}
    assert set(records) == {("dense", 8), ("dense", 16), ("ssm", 8), ("ssm", 16)}
    assert all(r["median_seconds"] > 0 and r["memory_bytes"] > 0 for r in records.values())
    growth = records["dense", 16]["cache_bytes"] - records["dense", 8]["cache_bytes"]
    assert growth == 2 * 2 * 2 * 8 * 32 * 4  # layers x (key, value) x hypotheses x 8 more tokens x d_model x float32
    assert records["ssm", 16]["cache_bytes"] == records["ssm", 8]["cache_bytes"]
    # Per mixer layer and hypothesis: the float32 state (heads x N x P) and the convolution's last 3 inputs.
    inner, heads = 2 * 32, 2 * 32 // 16
    per_layer = 2 * (heads * 8 * 16 * 4 + 3 * (inner + 2 * 8) * 4)
    cross = records["dense", 8]["cache_bytes"] - 2 * 2 * 2 * 8 * 32 * 4  # what does not depend on the length
    assert records["ssm", 8]["cache_bytes"] == cross + 2 * per_layer
    assert "ms/token" in (tmp_path / "cost.md").read_text()


def test_bleu_by_length_scores_each_group_of_source_lengths(tmp_path):
    """scripts/bleu_by_length.py on hand-built files: a run exact on the short sources and wrong on the long ones
    scores 100 and 0 on those groups, and the whole set as metrics.bleu does."""
    from transformer import metrics
    from transformer.tokenizer import train_tokenizer

    words = "the a cat dog sees runs big small red blue house tree".split()
    rng = np.random.default_rng(0)
    short = [" ".join(rng.choice(words, 5)) for _ in range(6)]
    long = [" ".join(rng.choice(words, 14)) for _ in range(4)]
    sources = short + long
    references = [s.upper() for s in sources]
    hypotheses = [s.upper() for s in short] + ["xyz " * 5 for _ in long]
    vocab = train_tokenizer(sources * 20, str(tmp_path / "vocab.model"), vocab_size=30)
    lengths = [len(ids) for ids in vocab.encode(sources)]
    edge = max(lengths[:6])
    assert edge < min(lengths[6:])  # the hand-built split is one of lengths
    for name, lines in (("src", sources), ("ref", references), ("hyp", hypotheses)):
        (tmp_path / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    command = [sys.executable, os.path.join(ROOT, "scripts", "bleu_by_length.py"), f"--source={tmp_path / 'src'}",
               f"--reference={tmp_path / 'ref'}", f"--vocab={tmp_path / 'vocab.model'}", f"--edges={edge}",
               f"--run=exact_short={tmp_path / 'hyp'}", f"--run=reference={tmp_path / 'ref'}"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in result.stdout.splitlines()[2:]}
    assert rows[f"1-{edge}"] == ["6", "100.00", "100.00"]
    assert rows[f"{edge + 1}+"] == ["4", "0.00", "100.00"]
    assert rows["all"] == ["10", f"{metrics.bleu(hypotheses, references)['bleu']:.2f}", "100.00"]


def test_the_input_benchmark_compares_a_mixture_of_parts_with_one_source(tmp_path):
    pairs = corpus.builtin_split("train", seed=1, train_size=3000)
    for side, lang in enumerate(("en", "es")):
        (tmp_path / f"c.{lang}").write_text("".join(pair[side] + "\n" for pair in pairs), encoding="utf-8")
    output = tmp_path / "input.json"
    command = [sys.executable, os.path.join(ROOT, "scripts", "benchmark_input.py"), f"--text_dir={tmp_path}",
               "--prefix=c", "--target_lang=es", f"--workdir={tmp_path / 'w'}", "--vocab_size=300",
               "--max_length=64", "--tokens_per_batch=1024", "--num_batches=20", "--workers=0", f"--output={output}"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = {record["stage"]: record for record in json.loads(output.read_text())}
    one, mixed = records["packed batches"], records["mixture of 3"]
    assert one["batches"] == mixed["batches"] == 20 and mixed["target_tokens"] > 0
    assert abs(mixed["targets_padding"] - one["targets_padding"]) < 0.05  # the same packing of the same pairs
    assert "mixture of 3 / one source, workers=0:" in result.stdout
