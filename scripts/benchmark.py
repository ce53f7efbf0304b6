"""Benchmark the training step, or check ahead of a job that a config compiles and fits in memory.

    # median step time, tokens/s and MFU at the 'small' shape of the reference benchmarks (docs/benchmarks.md)
    PYTHONPATH=. python scripts/benchmark.py --mode=train --shape=small
    # any config, batch and mesh; float32 or bfloat16; results appended to a JSONL
    PYTHONPATH=. python scripts/benchmark.py --mode=train --config=configs/base.py --batch=64 \\
        --config.model.dtype=bfloat16 --output=runs/bench.jsonl
    # lower and compile only: memory per device for a mesh, before the job starts
    PYTHONPATH=. python scripts/benchmark.py --compile_only --config=configs/big.py --config.mesh.fsdp=8
    # beam-4 decoding speed (--beam_size=1: greedy search)
    PYTHONPATH=. python scripts/benchmark.py --mode=decode --shape=small
    # a real text file through a workdir's model, as eval.py decodes it, beside its CTranslate2 export
    PYTHONPATH=. python scripts/benchmark.py --mode=decode --workdir=runs/multi30k --input=val.en --beam_size=1 \
        --decode_shrink=5 --ctranslate2=runs/multi30k/export/ctranslate2.step2464 --ct2_compute_type=int8
    # where the time goes: the 20 most expensive XLA ops of the step (or search), with their HLO
    PYTHONPATH=. python scripts/benchmark.py --mode=train --shape=small --profile=20

--mode=decode: beam search of `--batch` random source sentences of `--source_length` tokens, every sentence
decoding exactly `--new_tokens` tokens (early stopping off, as the Hugging Face Marian reference's `generate(eos_token_id=None)`), in
float32; reports sentences/s and new tokens/s (batch * new_tokens / time, as that reference counts them). Median of
--repeats timed runs after one compiling run. `--beam_size=1` times greedy search instead, as eval.py runs it (a
random model rarely emits EOS, so it too runs to the limit). `--config.decode.cache_blocks=N` sets the
self-attention cache's blocks (default: decode.cache_blocks_for's choice).

Batches are synthetic: every row holds `source_length` / `target_length` random non-padding tokens (no
packing), like the reference benchmark of a PyTorch Marian model (hf_throughput.py, docs/benchmarks.md). Model FLOPs are
transformer/throughput.model_flops; MFU is against a float32 4096^3 matmul measured in the same run on CPU
(--peak_size), or the table of device kinds on accelerators.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# glibc serves XLA's large per-step buffers with fresh mmaps: every step then takes a page fault per 4 KiB
# (~130k for the 'small' step) and the kernel zeroes each page. Transparent huge pages (glibc >= 2.35) cut the
# faults 40x and the CPU step time by ~20% here (docs/benchmarks.md). The loader reads the tunable at start,
# hence the re-exec (of the script only: importing this module, as the tests do, never re-executes the importer);
# --nohugepages (or --hugepages=false) measures without it.
HUGEPAGES = "glibc.malloc.hugetlb=1"


def wants_hugepages(argv: list[str]) -> bool:
    """--hugepages as absl will read it, before absl parses: the last of --[no]hugepages[=value] wins (default on)."""
    wanted = True
    for arg in argv[1:]:
        name, _, value = arg.lstrip("-").partition("=")
        if name == "nohugepages":
            wanted = False
        elif name == "hugepages":
            wanted = value.lower() not in ("false", "0", "f")
    return wanted


if (__name__ == "__main__" and wants_hugepages(sys.argv)
        and HUGEPAGES not in os.environ.get("GLIBC_TUNABLES", "")):
    tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES", ""), HUGEPAGES]))
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GLIBC_TUNABLES": tunables})

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "default.py")
config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Config file (any field overridable).", lock_config=True)
flags.DEFINE_enum("mode", "train", ["train", "decode"], "What to benchmark.")
flags.DEFINE_bool("compile_only", False, "Only lower and compile the train step; report memory per device.")
flags.DEFINE_enum("shape", None, ["small", "base"], "The reference benchmarks' shapes (docs/benchmarks.md): set the model, "
                  "vocabulary, dropout 0.1 and batch; overrides the config's model fields.")
flags.DEFINE_integer("batch", 64, "Sentences per step (rows).")
flags.DEFINE_integer("source_length", 32, "Source tokens per row.")
flags.DEFINE_integer("target_length", 32, "Target tokens per row.")
flags.DEFINE_integer("vocab_size", 8000, "Vocabulary size (the config's tokenizer is not trained here).")
flags.DEFINE_integer("steps", 25, "Timed steps; the median is reported.")
flags.DEFINE_integer("warmup", 3, "Untimed steps after compilation.")
flags.DEFINE_integer("peak_size", 4096, "CPU: size of the float32 matmul whose FLOP/s is the MFU peak.")
flags.DEFINE_bool("hugepages", True, "Re-run under GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (see above).")
flags.DEFINE_integer("new_tokens", 40, "decode: tokens decoded per sentence (no early stop).")
flags.DEFINE_integer("beam_size", 4, "decode: beam size (1: greedy search).")
flags.DEFINE_integer("candidates", 0, "decode: > 0 draws this many samples per sentence instead (temperature 1, "
                     "epsilon 0.02: MBR's device part, decode.search=mbr; --beam_size is not read).")
flags.DEFINE_enum("decode_weights", "float32", ["float32", "bfloat16"], "decode: decode.weights, the dtype of "
                  "the search's weights and matmuls.")
flags.DEFINE_integer("repeats", 3, "decode: timed runs (the median is reported).")
flags.DEFINE_integer("decode_shrink", 0, "decode: decode.shrink, the most halvings of a batch as its sentences "
                     "finish (with --workdir; random sentences all run to the limit).")
flags.DEFINE_string("workdir", None, "decode: translate --input with this workdir's model and decode settings (batch "
                    "size, alpha, length penalty) instead of random sentences; --beam_size, --decode_weights and "
                    "--decode_shrink override them.")
flags.DEFINE_string("input", None, "decode with --workdir: the text file of source sentences, one per line.")
flags.DEFINE_string("ctranslate2", None, "decode with --workdir: also time this CTranslate2 export of the same model "
                    "(scripts/export.py --format=ctranslate2) on the same sentences and pieces, in the same sitting.")
flags.DEFINE_enum("ct2_compute_type", "int8", ["float32", "int8", "int8_float32", "bfloat16"], "decode with "
                  "--ctranslate2: its compute type.")
flags.DEFINE_bool("decode_all_devices", False, "decode: split the batch's rows over every device, as decode.search_sentences "
                  "does (8 fake CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=8).")
flags.DEFINE_string("output", "", "Append the result as one JSON line to this file.")
flags.DEFINE_integer("profile", 0, "Also trace the step (train) or the cached search (decode) with jax.profiler "
                     "and print the N most expensive XLA ops with their HLO, and the time per op kind.")

# The reference benchmarks' shapes (small and base of docs/benchmarks.md), with their dropout 0.1 on embeddings and
# sublayers.
SHAPES = {
    "small": dict(model=dict(emb_dim=256, num_encoder_layers=3, num_decoder_layers=3, num_heads=4, mlp_dim=1024),
                  vocab_size=8000, batch=64, source_length=32, target_length=32),
    "base": dict(model=dict(emb_dim=512, num_encoder_layers=6, num_decoder_layers=6, num_heads=8, mlp_dim=2048),
                 vocab_size=32000, batch=32, source_length=32, target_length=32),
}


def apply_shape(config, shape: str | None) -> dict:
    """The --shape preset written into the config; returns batch/length/vocab (the flags' values otherwise)."""
    sizes = dict(batch=flags.FLAGS.batch, source_length=flags.FLAGS.source_length,
                 target_length=flags.FLAGS.target_length, vocab_size=flags.FLAGS.vocab_size)
    if shape:
        preset = SHAPES[shape]
        for key, value in preset["model"].items():
            config.model[key] = value
        config.model.dropout_rate = 0.1
        config.model.share_embeddings = config.model.tie_output_embedding = True
        # Decoding is measured on 64 sentences at both shapes (the reference benchmarks' decode batch); training on the preset's.
        keep = ("model", "batch") if flags.FLAGS.mode == "decode" else ("model",)
        sizes.update({k: v for k, v in preset.items() if k not in keep})
    return sizes


def synthetic_batch(batch: int, source_length: int, target_length: int, vocab_size: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"inputs": rng.integers(3, vocab_size, (batch, source_length), dtype=np.int32),
            "targets": rng.integers(3, vocab_size, (batch, target_length), dtype=np.int32)}


def build(config, sizes: dict):
    """Everything a train step needs, from the config and sizes: model config, mesh, shardings, steps."""
    from transformer import sharding
    from transformer.optim import make_optimizer
    from transformer.plan import make_steps, model_graphdef, state_shardings
    from transformer.settings import Settings

    settings = Settings.from_config(config)
    model_config = settings.model_config(sizes["vocab_size"])
    optimizer, schedule = make_optimizer(settings.optimizer, model_config.emb_dim)
    mesh = sharding.make_mesh(settings.mesh)
    sharding.check_batch_divisible(sizes["batch"] // settings.train.num_microbatches, mesh, settings.mesh,
                                   "--batch / train.num_microbatches")
    shardings = state_shardings(model_config, optimizer, mesh, settings.mesh)
    batch_sharding = sharding.batch_sharding(mesh, settings.mesh)
    train, _ = make_steps(model_graphdef(model_config), optimizer, schedule, settings.train, shardings, batch_sharding)
    return settings, model_config, optimizer, mesh, shardings, batch_sharding, train


def memory_of(compiled) -> dict:
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {}
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
              "generated_code_size_in_bytes")
    memory = {name: int(getattr(analysis, name, 0) or 0) for name in fields}
    # Donated state aliases its outputs: arguments + outputs - aliased + temporaries is the step's footprint.
    memory["total_per_device_bytes"] = (memory["argument_size_in_bytes"] + memory["output_size_in_bytes"]
                                        - memory["alias_size_in_bytes"] + memory["temp_size_in_bytes"])
    return memory


def describe(config, sizes: dict, mesh) -> dict:
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "cpus": os.cpu_count(), "device_kind": jax.devices()[0].device_kind,
            "devices": jax.device_count(), "mesh": dict(mesh.shape), "jax": jax.__version__,
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "model": config.model.to_dict(), "train": {"num_microbatches": config.train.num_microbatches,
                                                       "dropout_rng": config.train.dropout_rng}, **sizes}


def run_compile_only(config, sizes: dict) -> dict:
    """Lower and compile the train step exactly as train.py would for the config and mesh (its batch, microbatches
    and vocabulary), with no array allocated; the memory per device XLA plans for it."""
    from transformer.plan import make_steps, startup_plan
    from transformer.settings import Settings

    settings = Settings.from_config(config)
    plan, note = startup_plan(settings)
    if note:
        print(note, flush=True)
    train, _ = make_steps(plan.graphdef, plan.optimizer, plan.schedule, settings.train, plan.state_shardings,
                          plan.batch_sharding)
    start = time.perf_counter()
    lowered = train.lower(plan.abstract_state(settings.seed), plan.abstract_batch())
    lower_seconds = time.perf_counter() - start
    compiled = lowered.compile()
    sizes = dict(sizes, batch=plan.batch.rows, source_length=plan.batch.row_length,
                 target_length=plan.batch.row_length, vocab_size=plan.model_config.vocab_size)
    result = describe(config, sizes, plan.mesh)
    result.update(mode="compile_only", compile_seconds=time.perf_counter() - start, lower_seconds=lower_seconds,
                  memory=memory_of(compiled),
                  tokens_per_step=plan.batch.tokens, microbatches=settings.train.num_microbatches,
                  batch_note=note or "")
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if limit:
        result["memory"]["device_limit_bytes"] = int(limit)
        result["fits"] = result["memory"]["total_per_device_bytes"] <= limit
    return result


def run_train(config, sizes: dict, *, steps: int, warmup: int, peak_size: int) -> dict:
    """Compile time, median step time over `steps` after `warmup`, tokens/s, MFU and peak memory."""
    from transformer import sharding, throughput
    from transformer.checkpoint import abstract_like
    from transformer.plan import create_train_state

    settings, model_config, optimizer, mesh, state_shardings, batch_sharding, train = build(config, sizes)
    state = create_train_state(model_config, optimizer, settings.seed, state_shardings)
    host_batch = synthetic_batch(sizes["batch"], sizes["source_length"], sizes["target_length"],
                                 model_config.vocab_size)
    batch = sharding.place_batch(host_batch, batch_sharding)
    start = time.perf_counter()
    compiled = train.lower(abstract_like(state), abstract_like(batch)).compile()
    compile_seconds = time.perf_counter() - start
    for _ in range(warmup):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    if not np.isfinite(float(metrics["loss"])):
        raise FloatingPointError("non-finite loss in the benchmark")
    profile = {}
    if flags.FLAGS.profile:
        def step():
            nonlocal state
            state, _ = compiled(state, batch)
            return state
        profile = profile_ops(step, 3, compiled.as_text(), flags.FLAGS.profile)
    median = float(np.median(times))
    device = jax.devices()[0]
    if device.platform == "cpu":  # measured now, in the same conditions as the steps
        peak, peak_from = throughput.measure_matmul_flops(peak_size), f"float32 {peak_size}^3 matmul, median of 5"
    else:
        peak, peak_from = throughput.device_peak_flops(device, model_config.dtype), "device table"
    flops = throughput.model_flops_of_shape(model_config, sizes["batch"], sizes["source_length"],
                                            sizes["target_length"])
    target_tokens = float(jax.device_get(metrics["denominator"]))
    source_tokens = float(jax.device_get(metrics["source_tokens"]))
    result = describe(config, sizes, mesh)
    result.update(
        mode="train", compile_seconds=compile_seconds, median_step_seconds=median, min_step_seconds=min(times),
        max_step_seconds=max(times), steps=steps, target_tokens_per_second=target_tokens / median,
        tokens_per_second=(target_tokens + source_tokens) / median, model_flops_per_step=flops,
        peak_flops=peak and peak * jax.device_count(), peak_from=peak_from,
        mfu=peak and flops / median / (peak * jax.device_count()), memory=memory_of(compiled),
        max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, final_loss=float(metrics["loss"]
                                                                                                 / target_tokens))
    if profile:
        result["profile"] = profile
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        result["memory"]["peak_bytes_in_use"] = int(stats["peak_bytes_in_use"])
    return result


def profile_ops(fn, calls: int, hlo_text: str, top: int) -> dict:
    """Run fn() `calls` times under jax.profiler and sum each XLA op's (thunk's) time per call: where the time
    goes, op by op. Ops may overlap on several threads, so the sum can exceed the wall time a little."""
    import collections
    import glob
    import gzip
    import re
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(fn())
        with gzip.open(glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)[0]) as handle:
            events = json.load(handle)["traceEvents"]
    per_op = collections.Counter()
    for event in events:  # leaf ops only: not the executor, the thread pool, python frames or the jit call
        if event.get("ph") == "X" and not event["name"].startswith(("ThunkExecutor", "$", "Slinky", "Pjit")):
            per_op[event["name"]] += event["dur"] / 1e3 / calls
    instructions = {}
    for line in hlo_text.splitlines():
        match = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*)", line)
        if match:
            instructions.setdefault(match.group(1), re.sub(r", metadata=.*", "", match.group(2)))
    kinds = collections.Counter()
    for name, ms in per_op.items():
        kinds[re.sub(r"\.\d+$", "", name)] += ms
    print(f"\nXLA ops, ms per call (sum {sum(per_op.values()):,.1f}), by kind:")
    for kind, ms in kinds.most_common(12):
        print(f"{ms:10.1f}  {kind}")
    print(f"the {top} most expensive:")
    for name, ms in per_op.most_common(top):
        print(f"{ms:10.1f}  {name}: {instructions.get(name, '?')[:160]}")
    return {"sum_ms": sum(per_op.values()), "kinds_ms": dict(kinds.most_common(12)),
            "top_ms": dict(per_op.most_common(top))}


def timed(fn, repeats: int) -> tuple[float, list[float], Any]:
    """(seconds of the first, compiling, call; seconds of each of `repeats` further calls; the first call's result)."""
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return first, times, result


def run_decode(config, sizes: dict, *, new_tokens: int, beam_size: int, repeats: int) -> dict:
    """Beam (or greedy) search of random sentences on a random-init model of the config's shape, float32."""
    import statistics

    from flax import nnx

    from transformer import batching, decode
    from transformer.model import build as build_model
    from transformer.settings import Settings

    batch, source_length = sizes["batch"], sizes["source_length"]
    if new_tokens < source_length:
        raise app.UsageError(f"--new_tokens={new_tokens} must be >= --source_length={source_length}: "
                             "an output may have at most source length + max_extra_length tokens")
    with config.unlocked():
        config.model.dtype, config.model.dropout_rate = "float32", 0.0
    settings = Settings.from_config(config)
    config = settings.model_config(sizes["vocab_size"])
    cache_blocks = decode.cache_blocks_for(settings.decode.cache_blocks, beam_size)
    graphdef, params = nnx.split(build_model(config, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    weights = flags.FLAGS.decode_weights
    if weights != "float32":
        graphdef = decode.weights_graphdef(config, weights)
    inputs = np.random.default_rng(1).integers(3, config.vocab_size, size=(batch, source_length)).astype(np.int32)
    if flags.FLAGS.decode_all_devices:
        from transformer import sharding
        batch_sharding = batching.batch_sharding_for()
        if batching.device_rows(batch, batch_sharding) != batch:
            raise app.UsageError(f"--batch={batch} cannot be split into whole rows over {jax.device_count()} devices")
        inputs = sharding.place_batch({"inputs": inputs}, batch_sharding)["inputs"]
    # Every sentence may produce source_length + max_extra_length = new_tokens tokens, and without early stopping
    # every sentence runs to that limit (greedy search stops only once every row has its EOS, as make_search's).
    candidates = flags.FLAGS.candidates
    if candidates > 0:  # a random model seldom samples EOS: the rows run to the limit, as beam search's here
        cache_blocks = decode.cache_blocks_for(settings.decode.cache_blocks, candidates)
        search = decode.make_search(graphdef, max_extra_length=new_tokens - source_length, temperature=1.0,
                                    epsilon=0.02, candidates=candidates, cache_blocks=cache_blocks, weights=weights)
        beam_size = 0
    else:
        search = decode.make_search(graphdef, max_extra_length=new_tokens - source_length, beam_size=beam_size,
                                    alpha=0.6, early_stopping=False, cache_blocks=cache_blocks, weights=weights)
    result = dict(mode="decode", shape=flags.FLAGS.shape, batch=batch, source_length=source_length,
                  new_tokens=new_tokens, beam_size=beam_size, candidates=candidates, cache_blocks=cache_blocks,
                  dtype="float32", weights=weights,
                  backend=jax.default_backend(), devices=str(jax.devices()), jax=jax.__version__,
                  batch_devices=jax.device_count() if flags.FLAGS.decode_all_devices else 1,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  model={key: getattr(config, key) for key in (
                      "emb_dim", "num_heads", "num_encoder_layers", "num_decoder_layers", "mlp_dim", "vocab_size",
                      "family", "encoder_attention", "decoder_attention", "cross_attention")})
    first, times, sequences = timed(lambda: search(params, inputs), repeats)
    sequences = np.asarray(sequences)
    median = statistics.median(times)
    result["cached"] = dict(first_call_seconds=first, seconds=times, median_seconds=median,
                            sentences_per_second=batch / median, tokens_per_second=batch * new_tokens / median,
                            decoded_length=int(np.max(np.sum(sequences != 0, axis=1))))
    print(f"cached: {batch / median:.1f} sentences/s, {batch * new_tokens / median:.0f} tokens/s "
          f"(median of {[round(t, 3) for t in times]} s; first call {first:.1f} s)", flush=True)
    if flags.FLAGS.profile:
        # The jitted call does not expose its executable: compile the same program again (untimed) for the HLO
        # that names the traced ops.
        hlo = search.run.lower(params, inputs, decode.default_streams(batch)).compile().as_text()
        result["profile"] = profile_ops(lambda: search(params, inputs), 1, hlo, flags.FLAGS.profile)
    return result


def run_decode_text(workdir: str, input_path: str, *, beam_size: int, repeats: int) -> dict:
    """Translate a text file with a workdir's model as eval.py does (its checkpoint averaging; search_sentences:
    length-sorted batches of decode.batch_size, the token budget, early stopping), the first pass compiling every
    batch shape, then the median of `repeats` timed passes; with --ctranslate2, CTranslate2 on the same sentences' pieces, beam and
    batch size, no length penalty on either side when the workdir's alpha is 0."""
    import statistics

    from transformer import cli
    from transformer.evaluation import Evaluator

    # eval.py's rule: the workdir's decode settings (checkpoint averaging included) but for these flags.
    restored = cli.restore_for_command_line(workdir, None, average_last=None, best=False, nbest=0,
                                            beam_size=beam_size, weights=flags.FLAGS.decode_weights,
                                            shrink=flags.FLAGS.decode_shrink)
    with open(input_path, encoding="utf-8") as handle:
        sentences = [line.rstrip("\n") for line in handle]
    evaluator = Evaluator.of(restored)
    settings = restored.settings.decode
    first, times, translated = timed(lambda: evaluator.translate(restored.params, sentences, None), repeats)
    translations = translated.hypotheses
    median = statistics.median(times)
    result = dict(mode="decode_text", workdir=workdir, input=input_path, sentences=len(sentences),
                  beam_size=beam_size, alpha=settings.alpha, batch_size=settings.batch_size,
                  max_tokens_per_batch=settings.max_tokens_per_batch, weights=settings.weights, shrink=settings.shrink,
                  backend=jax.default_backend(), jax=jax.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  first_pass_seconds=first, seconds=times, sentences_per_second=len(sentences) / median,
                  translations=translations)
    print(f"ours: {len(sentences) / median:.1f} sentences/s (median of {[round(t, 2) for t in times]} s; first "
          f"pass, compiling, {first:.1f} s)", flush=True)
    if flags.FLAGS.ctranslate2:
        import ctranslate2
        translator = ctranslate2.Translator(flags.FLAGS.ctranslate2, device="cpu",
                                            compute_type=flags.FLAGS.ct2_compute_type,
                                            intra_threads=os.cpu_count() or 1)
        tokenizer = restored.tokenizer
        pieces = [[tokenizer.id_to_piece(int(i)) for i in ids]
                  for ids in tokenizer.encode_lists(sentences, "source")]
        options = dict(beam_size=beam_size, max_batch_size=settings.batch_size, length_penalty=settings.alpha,
                       max_decoding_length=settings.max_extra_length + max(map(len, pieces)))
        _, ct2_times, found = timed(lambda: translator.translate_batch(pieces, **options), repeats)
        ct2_median = statistics.median(ct2_times)
        ct2_text = [tokenizer.decode([tokenizer.piece_to_id(piece) for piece in r.hypotheses[0]]) for r in found]
        same = sum(a == b for a, b in zip(ct2_text, translations))
        result["ctranslate2"] = dict(compute_type=flags.FLAGS.ct2_compute_type, seconds=ct2_times,
                                     sentences_per_second=len(sentences) / ct2_median, same_translations=same)
        print(f"CTranslate2 {flags.FLAGS.ct2_compute_type}: {len(sentences) / ct2_median:.1f} sentences/s (median "
              f"of {[round(t, 2) for t in ct2_times]} s); {same} of {len(sentences)} translations the same as ours",
              flush=True)
    return result


def print_table(result: dict) -> None:
    rows = [("mode", result["mode"]), ("device", f"{result['devices']} x {result['device_kind']}"),
            ("mesh", result["mesh"]), ("batch", f"{result['batch']} x {result['source_length']} x "
                                                 f"{result['target_length']}, vocab {result['vocab_size']}"),
            *([("tokens per step", f"{result['tokens_per_step']:,} per side in {result['microbatches']} "
                                   "microbatch(es)")] if "tokens_per_step" in result else []),
            ("compile", f"{result['compile_seconds']:.1f} s" + (
                f" (trace and lower {result['lower_seconds']:.1f} s)" if "lower_seconds" in result else ""))]
    if result["mode"] == "train":
        rows += [("median step", f"{result['median_step_seconds'] * 1000:.1f} ms "
                                 f"(min {result['min_step_seconds'] * 1000:.1f}, max "
                                 f"{result['max_step_seconds'] * 1000:.1f}, {result['steps']} steps)"),
                 ("target tokens/s", f"{result['target_tokens_per_second']:,.0f}"),
                 ("tokens/s (src+tgt)", f"{result['tokens_per_second']:,.0f}"),
                 ("model GFLOP/step", f"{result['model_flops_per_step'] / 1e9:.2f}")]
        if result["mfu"]:
            rows += [("peak GFLOP/s", f"{result['peak_flops'] / 1e9:,.1f} ({result['peak_from']})"),
                     ("MFU", f"{result['mfu']:.3f}")]
        rows.append(("max RSS", f"{result['max_rss_bytes'] / 2**20:,.0f} MiB"))
    # Fake CPU devices get the CPU compiler's plan: a check that the shapes split, not an accelerator's footprint.
    where = " (CPU compiler)" if result["mode"] == "compile_only" and result["device_kind"] == "cpu" else ""
    for name, value in result.get("memory", {}).items():
        rows.append((name + where, f"{value / 2**20:,.1f} MiB"))
    if "fits" in result:
        rows.append(("fits in device memory", result["fits"]))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = flags.FLAGS.config
    with config.unlocked():
        sizes = apply_shape(config, flags.FLAGS.shape)
        if config.data.source == "text" and not config.data.text_dir:
            # No mode reads data (the batches are synthetic, the vocabulary is --vocab_size), so a config that
            # reads a local folder benchmarks without one; its batch and lengths are unchanged.
            config.data.source = "builtin"
    if flags.FLAGS.mode == "decode" and flags.FLAGS.workdir:
        if not flags.FLAGS.input:
            raise app.UsageError("--workdir decodes the sentences of --input: name a text file")
        result = run_decode_text(flags.FLAGS.workdir, flags.FLAGS.input, beam_size=flags.FLAGS.beam_size,
                                 repeats=flags.FLAGS.repeats)
    elif flags.FLAGS.mode == "decode":
        result = run_decode(config, sizes, new_tokens=flags.FLAGS.new_tokens, beam_size=flags.FLAGS.beam_size,
                            repeats=flags.FLAGS.repeats)
    elif flags.FLAGS.compile_only:
        result = run_compile_only(config, sizes)
    else:
        result = run_train(config, sizes, steps=flags.FLAGS.steps, warmup=flags.FLAGS.warmup,
                           peak_size=flags.FLAGS.peak_size)
    if result["mode"] not in ("decode", "decode_text"):
        print_table(result)
    if flags.FLAGS.output:
        os.makedirs(os.path.dirname(os.path.abspath(flags.FLAGS.output)), exist_ok=True)
        with open(flags.FLAGS.output, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    app.run(main)
