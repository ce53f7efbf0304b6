"""Cost against length, per attention kind: forward + backward time and memory of one self-attention layer and
of a whole train step, at sequence lengths 256, 512, ..., 16384, as far as memory holds; and the cost of decoding
`length` tokens (time per token and memory), where a state-space decoder keeps a fixed-size state.

    PYTHONPATH=. python scripts/benchmark_attention.py --output_dir=runs/attention_cost
    PYTHONPATH=. python scripts/benchmark_attention.py --kinds=dense,local --max_length=4096 --output_dir=runs/ac
    PYTHONPATH=. python scripts/benchmark_attention.py --parts=decode --kinds=dense,ssm --min_length=128 \
        --max_length=8192 --output_dir=runs/decode_cost

Writes `cost.jsonl` (one line per kind, part and length), `cost.md` (the table and the crossover lengths) and
`cost.png` (log-log time and memory against length; the `plot` extra). The layer is the encoder's self-attention
sublayer (projections included) on one row of `length` tokens; the step is train.py's train step of the
model (--config, any field overridable) on one row of `length` source and `length` target tokens, the kind set
in every sublayer that takes it (cross-attention stays dense for local, linformer and ssm; performer has all three;
ssm, a decoder kind, is measured as the decoder's causal layer). The decode part encodes a 16-token source and
runs the model's own decode_step for `length` positions (the argmax fed back, no stop at EOS) for
--decode_hypotheses hypotheses with beam search's cache blocks, as one jitted loop: time per token is its median
time over `length` (encoding the source and building the cache, once, included); memory is its plan (the cache included) and the cache's own size.
Memory is what XLA plans for the compiled function (arguments + outputs - donated + temporaries), read before it
runs: a length whose plan exceeds --memory_gib is recorded as out of memory and not run, which is where dense
stops. Time is the median of --repeats runs after a
compiling one (--repeats, scripts/benchmark.py's flag); compile time is reported apart.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

import benchmark  # noqa: E402  (scripts/benchmark.py: its --config flag, its train-step builder and memory reading)

flags.DEFINE_list("kinds", ["dense", "local", "linformer", "performer"], "Attention kinds to measure.")
flags.DEFINE_list("parts", ["layer", "step"], "layer: one self-attention sublayer; step: the whole train step; "
                  "decode: `length` decoding steps of the whole model.")
flags.DEFINE_integer("decode_hypotheses", 4, "decode: hypotheses decoded together (beam 4's width).")
flags.DEFINE_integer("min_length", 256, "First sequence length; each next one doubles it.")
flags.DEFINE_integer("max_length", 16384, "Last sequence length.")
flags.DEFINE_float("memory_gib", 0.0, "A point whose planned memory exceeds this is recorded as out of memory "
                   "(0: the device's limit, or 40% of this machine's memory on a CPU, where XLA's plan undercounts: a dense "
                   "layer at 16,384 tokens planned under 70% of 24 GiB was killed for memory).")
flags.DEFINE_float("max_seconds", 120.0, "After a point slower than this, the kind's longer lengths are skipped.")
flags.DEFINE_string("output_dir", None, "Where cost.jsonl, cost.md and cost.png go.", required=True)
FLAGS = flags.FLAGS


def memory_budget() -> float:
    if FLAGS.memory_gib:
        return FLAGS.memory_gib * 2**30
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    return float(limit) if limit else 0.4 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def with_kind(config, kind: str, length: int):
    """The config with `kind` in every sublayer where it may go (local: both self-attentions; linformer: the
    encoder's, its projection as long as the row; performer: all three), one sentence per row where the kind
    mixes a row's positions."""
    from transformer.model import blocks
    from transformer.model.config import ATTENTION_FIELDS, allowed_kinds

    config = config.copy_and_resolve_references()
    with config.unlocked():
        for field in ATTENTION_FIELDS:
            config.model[field] = kind if kind in allowed_kinds(field) else "dense"
        config.data.pack = not blocks.lookup("self_attention", kind).mixes_row
        if kind == "linformer":
            config.model.max_length = max(config.model.max_length, length)
    return config


def layer_function(config, kind: str, length: int):
    """forward + backward of the encoder's self-attention sublayer (a decoder-only kind: the decoder's) on one row
    of `length` tokens."""
    from transformer.model import ModelConfig, blocks
    from transformer.model.masks import SelfMask

    from transformer.model.config import allowed_kinds

    model_config = ModelConfig(vocab_size=8, **with_kind(config, kind, length).model.to_dict())
    field = "encoder_attention" if kind in allowed_kinds("encoder_attention") else "decoder_attention"
    module = blocks.lookup("self_attention", kind)(model_config, field, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(module)
    x = jax.random.normal(jax.random.key(1), (1, length, model_config.emb_dim), model_config.compute_dtype)
    mask = SelfMask(jnp.ones((1, length), jnp.int32))

    def loss(params, x):
        layer = nnx.merge(graphdef, params)
        inputs = layer.prepare(blocks.Inputs(self_mask=mask))
        return jnp.sum(layer(x, inputs, deterministic=True, rngs=None)[0].astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x)


def step_function(config, kind: str, length: int):
    """train.py's train step on one row of `length` source and `length` target tokens."""
    from transformer import sharding
    from transformer.plan import create_train_state

    sizes = dict(batch=1, source_length=length, target_length=length, vocab_size=8000)
    settings, model_config, optimizer, _, state_shardings, batch_sharding, train = benchmark.build(
        with_kind(config, kind, length), sizes)
    state = create_train_state(model_config, optimizer, settings.seed, state_shardings)
    batch = sharding.place_batch(benchmark.synthetic_batch(1, length, length, 8000), batch_sharding)
    return train, (state, batch)


def decode_function(config, kind: str, length: int):
    """`length` decoding steps of the model with `kind` in its decoder's self-attention, for --decode_hypotheses
    hypotheses of one 16-token source, the argmax fed back: the decoding loop without a search's bookkeeping."""
    from transformer.decode import cache_blocks_for
    from transformer.model import ModelConfig, build

    config = with_kind(config, kind, length)
    model_config = ModelConfig(vocab_size=8000, **config.model.to_dict())
    graphdef, params = nnx.split(build(model_config, rngs=nnx.Rngs(0)))
    hypotheses = FLAGS.decode_hypotheses
    inputs = jnp.asarray(np.random.default_rng(0).integers(3, 8000, (1, 16)), jnp.int32)

    def cache_for(params, inputs):
        model = nnx.merge(graphdef, params)
        return model.init_cache(model.encode(inputs), inputs, length, hypotheses=hypotheses,
                                blocks=cache_blocks_for(0, hypotheses))

    @jax.jit
    def decode(params, inputs):
        model = nnx.merge(graphdef, params)

        def step(position, carry):
            tokens, cache = carry
            logits, cache = model.decode_step(tokens, position, cache)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache
        start = (jnp.zeros((1, hypotheses), jnp.int32), cache_for(params, inputs))
        return jax.lax.fori_loop(0, length, step, start)[0]
    cache = jax.eval_shape(cache_for, params, inputs)
    cache_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache))
    return decode, (params, inputs), {"cache_bytes": int(cache_bytes), "hypotheses": hypotheses}


def measure(function, arguments, budget: float, per: int = 1) -> dict:
    start = time.perf_counter()
    compiled = function.lower(*arguments).compile()
    record = {"compile_seconds": time.perf_counter() - start, "memory_bytes": None}
    record["memory_bytes"] = benchmark.memory_of(compiled).get("total_per_device_bytes")
    if record["memory_bytes"] and record["memory_bytes"] > budget:
        return {**record, "out_of_memory": True}
    times = []
    for _ in range(FLAGS.repeats + 1):  # the first run pays for allocation: not timed
        start = time.perf_counter()
        out = compiled(*arguments)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
        if isinstance(out, tuple) and len(out) == 2 and hasattr(out[0], "params"):
            arguments = (out[0], *arguments[1:])  # the train step donates its state
    return {**record, "out_of_memory": False, "median_seconds": float(np.median(times[1:])) / per}


def crossovers(records: list[dict]) -> dict:
    """Per kind and part: the shortest measured length from which the kind is faster than dense at every longer
    one (a length dense could not run counts as faster), or None."""
    found = {}
    for part in {r["part"] for r in records}:
        dense = {r["length"]: r.get("median_seconds") for r in records if (r["part"], r["kind"]) == (part, "dense")}
        for kind in {r["kind"] for r in records} - {"dense"}:
            timed = sorted((r["length"], r["median_seconds"]) for r in records
                           if (r["part"], r["kind"]) == (part, kind) and "median_seconds" in r)
            start = None
            for length, seconds in reversed(timed):
                if dense.get(length) is not None and seconds >= dense[length]:
                    break
                start = length
            found[f"{kind} {part}"] = start
    return found


def write_table(records: list[dict], path: str) -> None:
    lengths = sorted({r["length"] for r in records})
    keys = sorted({(r["part"], r["kind"]) for r in records})
    def cell(record):
        if record is None:
            return "-"
        if record.get("out_of_memory"):
            return f"out of memory ({record['memory_bytes'] / 2**30:.1f} GiB planned)"
        if "median_seconds" not in record:
            return "not run (a shorter length ran out of memory or time)"
        if record["part"] == "decode":
            return (f"{record['median_seconds'] * 1e3:.3f} ms/token, {record['memory_bytes'] / 2**20:.1f} MiB "
                    f"(cache {record['cache_bytes'] / 2**20:.2f})")
        return f"{record['median_seconds'] * 1e3:.1f} ms, {record['memory_bytes'] / 2**20:.0f} MiB"
    by_key = {(r["part"], r["kind"], r["length"]): r for r in records}
    lines = ["| part | kind | " + " | ".join(str(n) for n in lengths) + " |", "|---|---|" + "---:|" * len(lengths)]
    lines += [f"| {part} | {kind} | " + " | ".join(cell(by_key.get((part, kind, n))) for n in lengths) + " |"
              for part, kind in keys]
    lines += ["", "Crossover (the shortest length from which the kind beats dense at every longer one): " + "; ".join(
        f"{name}: {length if length else 'none measured'}" for name, length in sorted(crossovers(records).items()))]
    device = records[0]["device"] if records else ""
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(f"Forward + backward time (median) and planned memory, on {device}; decode: time per generated "
                     "token, planned memory (the cache's own size).\n\n" + "\n".join(lines) + "\n")


def plot(records: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    for part, kind in sorted({(r["part"], r["kind"]) for r in records}):
        points = sorted((r for r in records if (r["part"], r["kind"]) == (part, kind)), key=lambda r: r["length"])
        style = dict(marker="o", linestyle={"step": "-", "layer": "--"}.get(part, ":"), label=f"{kind} ({part})")
        timed = [r for r in points if "median_seconds" in r]
        time_axis.plot([r["length"] for r in timed], [r["median_seconds"] for r in timed], **style)
        planned = [r for r in points if r.get("memory_bytes")]
        memory_axis.plot([r["length"] for r in planned], [r["memory_bytes"] / 2**20 for r in planned], **style)
    decode_only = {r["part"] for r in records} == {"decode"}
    time_label = "seconds per generated token" if decode_only else "forward + backward seconds (decode: per token)"
    for axis, label in ((time_axis, time_label), (memory_axis, "planned memory (MiB)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("generated tokens" if decode_only else "sequence length (tokens)")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
    time_axis.legend(fontsize=8)
    title = "Decoding cost against length" if decode_only else "Attention cost against length"
    figure.suptitle(f"{title} ({records[0]['device']})" if records else "")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv):
    del argv
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    budget, records = memory_budget(), []
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()}, {FLAGS.config.model.dtype})"
    lengths = [FLAGS.min_length * 2**i for i in range(64) if FLAGS.min_length * 2**i <= FLAGS.max_length]
    with open(os.path.join(FLAGS.output_dir, "cost.jsonl"), "a", encoding="utf-8") as jsonl:
        for part in FLAGS.parts:
            build = {"layer": layer_function, "step": step_function, "decode": decode_function}[part]
            for kind in FLAGS.kinds:
                stopped = False
                for length in lengths:
                    record = {"part": part, "kind": kind, "length": length, "device": device,
                              "window": FLAGS.config.model.local_window,
                              "linformer_length": FLAGS.config.model.linformer_length,
                              "performer_features": FLAGS.config.model.performer_features}
                    if not stopped:
                        function, arguments, *extra = build(FLAGS.config, kind, length)
                        record.update(extra[0] if extra else {})
                        record.update(measure(function, arguments, budget, per=length if part == "decode" else 1))
                        run_seconds = record.get("median_seconds", 0) * (length if part == "decode" else 1)
                        stopped = record["out_of_memory"] or run_seconds > FLAGS.max_seconds
                    records.append(record)
                    jsonl.write(json.dumps(record) + "\n")
                    jsonl.flush()
                    print(json.dumps(record), flush=True)
    write_table(records, os.path.join(FLAGS.output_dir, "cost.md"))
    plot(records, os.path.join(FLAGS.output_dir, "cost.png"))
    print(open(os.path.join(FLAGS.output_dir, "cost.md"), encoding="utf-8").read())


if __name__ == "__main__":
    app.run(main)
