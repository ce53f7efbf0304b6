"""Pure training and evaluation steps over pytrees: `train_step(state, batch)` and `eval_step(params, batch)`.

A batch is a dict of int32 arrays [batch, length]: `inputs`, `targets` and, for packed rows,
`inputs_segmentation`, `inputs_position`, `targets_segmentation`, `targets_position`. Token 0 is padding.
Metrics leave the steps as sums with a `denominator` (non-padding target tokens), so that averages stay
exact under padding, packing and accumulation across steps; `summarize` divides on the host.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from transformer import optim, risk
from transformer.model import ROUTER_STATS, join_pair, positions_of, segmentation_of
from transformer.tokenizer import EOS_ID, PAD_ID, UNK_ID

PyTree = Any
SUM_KEYS = ("loss", "nll", "correct", "denominator", "source_tokens",  # summed over batches and steps
            "encoder_pairs", "decoder_pairs", "cross_pairs", "nonfinite") + ROUTER_STATS + risk.SUMS
# A mixture of experts' router stats (model.route) leave the steps weighted by the batch's target tokens, like the
# loss, so that microbatches and windows average them exactly; summarize divides them by the tokens.


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: updates applied so far
    params: PyTree  # nested dict of float32 arrays (nnx pure dict)
    opt_state: PyTree
    rng: jax.Array  # uint32 [2] base key; step t uses fold_in(rng, t)


def shift_right(targets: jax.Array, segmentation: jax.Array | None = None) -> jax.Array:
    """Decoder inputs: targets shifted one place right, with the start symbol 0 opening every segment."""
    shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
    if segmentation is not None:
        shifted_segmentation = jnp.pad(segmentation, ((0, 0), (1, 0)))[:, :-1]
        shifted = jnp.where(segmentation == shifted_segmentation, shifted, 0)
    return shifted


def label_smoothed_cross_entropy(logits: jax.Array, targets: jax.Array, label_smoothing: float) -> jax.Array:
    """Per-token cross-entropy against (1 - eps) on the target and eps / (V - 1) on every other class,
    minus that distribution's entropy, so a perfect prediction scores 0 (tensor2tensor and flax wmt do
    the same). logits [..., V] float32, targets [...] int -> [...] float32."""
    return _smoothed_cross_entropy(logits, target_logit_of(logits, targets), label_smoothing,
                                   jax.nn.logsumexp(logits, axis=-1))


def target_logit_of(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def _smoothed_cross_entropy(logits, target_logit, label_smoothing, log_normalizer):
    # -sum_k soft_k (logit_k - lse) = lse - (conf - low) logit_target - low sum_k logit_k, since sum_k soft_k = 1:
    # a gather and a sum instead of a [tokens, vocab] one-hot and a second log-softmax.
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab_size - 1)
    entropy = -(confidence * jnp.log(confidence) + (vocab_size - 1) * low * jnp.log(low + 1e-20))
    smoothed = (confidence - low) * target_logit + low * jnp.sum(logits, axis=-1)
    return log_normalizer - smoothed - entropy


def token_metrics(logits: jax.Array, batch: dict[str, jax.Array], label_smoothing: float) -> dict[str, jax.Array]:
    """Sums over non-padding target tokens: smoothed loss, plain negative log-likelihood, correct (the target's
    logit is the largest: argmax's answer but for exact ties, without argmax's index reduction over
    [tokens, vocab])."""
    targets = batch["targets"]
    weights = (targets != 0).astype(jnp.float32)
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    target_logit = target_logit_of(logits, targets)
    return {
        "loss": jnp.sum(_smoothed_cross_entropy(logits, target_logit, label_smoothing, log_normalizer) * weights),
        "nll": jnp.sum((log_normalizer - target_logit) * weights),
        "correct": jnp.sum((target_logit >= jnp.max(logits, axis=-1)) * weights),
        "denominator": jnp.sum(weights),
        "source_tokens": jnp.sum(batch["inputs"] != 0).astype(jnp.float32),
    }


def attention_pairs(batch: dict[str, jax.Array], config=None) -> dict[str, jax.Array]:
    """Query-key pairs that attend within a segment (packed rows count each sentence's own square), for the
    analytic model-FLOP count (transformer/throughput.py). Causal self-attention counts the full square, as the
    dense masked matrices of the reference benchmarks (a PyTorch Marian model) do. Float sums, like the other SUM_KEYS. An encoder_only model's encoder pairs
    are those of the stream it reads (config.masked_side); decoder_only's joined stream is throughput's sum of
    the three."""
    source = batch.get("inputs_segmentation", (batch["inputs"] != 0).astype(jnp.int32))
    target = batch.get("targets_segmentation", (batch["targets"] != 0).astype(jnp.int32))

    def pairs(query, key):
        return jnp.sum((query[:, :, None] == key[:, None, :]) & (key[:, None, :] != 0)).astype(jnp.float32)
    if config is not None and config.family == "encoder_only":
        stream = masked_side_stream(batch, config.masked_side)[1]
        zero = jnp.zeros((), jnp.float32)
        return {"encoder_pairs": pairs(stream, stream), "decoder_pairs": zero, "cross_pairs": zero}
    return {"encoder_pairs": pairs(source, source), "decoder_pairs": pairs(target, target),
            "cross_pairs": pairs(target, source)}


def forward(model: nnx.Module, batch: dict[str, jax.Array], *, deterministic: bool,
            rngs: nnx.Rngs | None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Teacher-forced logits [batch, length, vocab] for a (possibly packed) batch, and the router stats of a
    mixture of experts ({} without one). An encoder_only model reads `inputs` alone (masked_batch's)."""
    if model.config.family == "encoder_only":
        return model(batch["inputs"], inputs_segmentation=batch["inputs_segmentation"],
                     inputs_position=batch["inputs_position"], deterministic=deterministic, rngs=rngs,
                     with_router_stats=True)
    targets_segmentation = batch.get("targets_segmentation")
    return model(batch["inputs"], shift_right(batch["targets"], targets_segmentation),
                 inputs_segmentation=batch.get("inputs_segmentation"), inputs_position=batch.get("inputs_position"),
                 targets_segmentation=targets_segmentation, targets_position=batch.get("targets_position"),
                 deterministic=deterministic, rngs=rngs, with_router_stats=True)


# ----------------------------------------------------------------------------------------------------
# Masked language modelling (model.family = "encoder_only")
#
# The mask symbol is token 0: padding and the decoder's start symbol elsewhere, it is never an encoder's input
# at a real position, so no vocabulary needs a symbol of its own (a model trained on any sentencepiece file
# masks the same way). The masking runs inside the jitted step, from the step's key: no host work per batch.

MASK_ID = PAD_ID
FIRST_PIECE = UNK_ID + 1  # random replacements are ordinary pieces, never padding, EOS or unknown
MASK_SALT = 0x6D61736B  # folded into the step's dropout key: the masking's own stream


def masked_side_stream(batch: dict[str, jax.Array], side: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What encoder_only reads of a translation batch: (tokens, segmentation, positions) [batch, length] of the
    source, the target, or both joined (join_pair: XLM's translation language modelling, the target numbered on
    from its source, so that the positions tell the sides apart)."""
    def side_of(name):
        tokens = batch[name]
        return (tokens, segmentation_of(tokens, batch.get(f"{name}_segmentation")),
                positions_of(tokens, batch.get(f"{name}_position")))
    if side == "both":
        return join_pair(*side_of("inputs"), *side_of("targets"))
    return side_of({"source": "inputs", "target": "targets"}[side])


def mask_tokens(key: jax.Array, tokens: jax.Array, segmentation: jax.Array, rate: float,
                vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """BERT's masking: each real token but EOS is chosen with probability `rate` (independently, as most
    implementations draw it); a chosen one becomes MASK_ID with probability 0.8, a random ordinary piece with 0.1,
    and stays itself with 0.1 -> (the model's inputs, labels: the chosen tokens' ids, 0 elsewhere)."""
    choose_key, kind_key, piece_key = jax.random.split(key, 3)
    chosen = (jax.random.uniform(choose_key, tokens.shape) < rate) & (segmentation != 0) & (tokens != EOS_ID)
    kind = jax.random.uniform(kind_key, tokens.shape)
    pieces = jax.random.randint(piece_key, tokens.shape, FIRST_PIECE, vocab_size, dtype=tokens.dtype)
    masked = jnp.where(chosen & (kind < 0.8), MASK_ID, jnp.where(chosen & (kind < 0.9), pieces, tokens))
    return masked, jnp.where(chosen, tokens, 0)


def eval_mask_key(batch: dict[str, jax.Array]) -> jax.Array:
    """Evaluation's masking key, a function of the batch's tokens alone: every evaluation of a split (during
    training, at its end, in eval.py) masks the same tokens, so their scores compare."""
    words = jnp.concatenate([batch["inputs"], batch["targets"]], axis=1).astype(jnp.uint32)
    weights = jnp.arange(1, words.size + 1, dtype=jnp.uint32).reshape(words.shape) * jnp.uint32(0x9E3779B1)
    return jax.random.fold_in(jax.random.key(0), jnp.sum(words * weights))


def masked_batch(batch: dict[str, jax.Array], key: jax.Array, config) -> dict[str, jax.Array]:
    """A translation batch -> encoder_only's: the masked stream as `inputs` (with its segmentation and
    positions), its labels as `targets`, so that token_metrics scores the chosen tokens alone."""
    tokens, segmentation, positions = masked_side_stream(batch, config.masked_side)
    masked, labels = mask_tokens(key, tokens, segmentation, config.mask_rate, config.vocab_size)
    return {"inputs": masked, "inputs_segmentation": segmentation, "inputs_position": positions, "targets": labels,
            "stream": tokens}


def sequence_risk(model: nnx.Module, batch: dict[str, jax.Array], *, deterministic: bool,
                  rngs: nnx.Rngs | None) -> dict[str, jax.Array]:
    """Minimum risk training's sums (transformer/risk.py) over batch["candidates"] [rows, k, length]: "weighted",
    each sentence's expected risk times its reference tokens (the objective's part, so that dividing by the tokens
    gives the token-weighted mean risk), and the SUMS metrics: the expected risks, the mean sampled BLEU (the
    model's expected reward, estimated by its k samples) and the sentences."""
    candidates = batch["candidates"]
    rows, count, length = candidates.shape
    flat = candidates.reshape(rows * count, length)
    logits, _ = forward(model, {"inputs": jnp.repeat(batch["inputs"], count, axis=0), "targets": flat},
                        deterministic=deterministic, rngs=rngs)
    token_log_probs = target_logit_of(logits, flat) - jax.nn.logsumexp(logits, axis=-1)
    log_probs = jnp.sum(jnp.where(flat != PAD_ID, token_log_probs, 0.0), axis=-1).reshape(rows, count)
    bleu = risk.sentence_bleu(candidates, batch["targets"][:, None, :])
    expected = risk.expected_risk(log_probs, 1.0 - bleu, risk.distinct(candidates))
    reference_tokens = jnp.sum(batch["targets"] != PAD_ID, axis=-1).astype(jnp.float32)
    real = reference_tokens > 0  # rows of padding weigh nothing
    return {"weighted": jnp.sum(reference_tokens * expected), "risk": jnp.sum(jnp.where(real, expected, 0.0)),
            "reward": jnp.sum(jnp.where(real, jnp.mean(bleu, axis=-1), 0.0)),
            "sentences": jnp.sum(real).astype(jnp.float32)}


def step_metrics(model: nnx.Module, batch: dict[str, jax.Array], label_smoothing: float, *, deterministic: bool,
                 rngs: nnx.Rngs | None, mask_key: jax.Array | None = None,
                 objective: risk.Objective | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(The summed training objective, the metric sums): the smoothed loss of every target token plus, for a
    mixture of experts, router_balance_weight x the load-balancing loss + router_z_weight x the z-loss, each per
    token (so the objective divided by the tokens is the mean loss plus the weighted router losses). An
    encoder_only model's targets are its masked tokens (masked_batch, from mask_key; eval_mask_key's when None).
    With a risk objective (batch["candidates"] drawn), (1 - weight) x that + weight x sequence_risk's part."""
    pairs = attention_pairs(batch, model.config)
    if model.config.family == "encoder_only":
        batch = masked_batch(batch, eval_mask_key(batch) if mask_key is None else mask_key, model.config)
    logits, router = forward(model, batch, deterministic=deterministic, rngs=rngs)
    metrics = {**token_metrics(logits, batch, label_smoothing), **pairs}
    if "stream" in batch:
        metrics["source_tokens"] = jnp.sum(batch["stream"] != 0).astype(jnp.float32)
    total = metrics["loss"]
    if router:
        config = model.config
        total = total + metrics["denominator"] * (config.router_balance_weight * router["router_balance"]
                                                          + config.router_z_weight * router["router_z"])
        metrics.update({key: value * metrics["denominator"] for key, value in router.items()})
    if objective is not None:
        sums = sequence_risk(model, batch, deterministic=deterministic, rngs=rngs)
        total = (1.0 - objective.weight) * total + objective.weight * sums.pop("weighted")
        metrics.update(sums)
    return total, metrics


# ----------------------------------------------------------------------------------------------------
# Dropout randomness
#
# Why our own bits: jax's threefry2x32 (and rbg, whose RngBitGenerator XLA's CPU backend computes no faster)
# costs ~12 ns per 32-bit word on this project's CPUs, ~10% of the 'small' train step for its 9M dropout
# decisions (docs/benchmarks.md). A keyed integer hash of each element's position is ~15x cheaper and, being a
# function of the global index alone, gives the same masks on every mesh, like threefry. It is registered as a
# JAX PRNG implementation, so nnx.Dropout, fold_in and split work unchanged: key derivation (seed, split,
# fold_in) stays threefry's; only the bulk bits come from the hash.


def _mix32(h: jax.Array) -> jax.Array:
    """lowbias32 (C. Wellons, hash-prospector): a bijection of uint32 with full avalanche (bias ~0.17)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def _counter_hash_bits(key: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
    """Bits of `shape` for a [2] uint32 key: word i = mix(mix(i ^ key0) + key1), i the row-major element index
    (two words per element for 64 bits). Distinct indices give distinct words under one key (a bijection).

    The key must come from threefry (seed, split, fold_in, as every key here does): lowbias32 has additive weak
    spots (mix(x) and mix(x + 0x80008000) correlate at ~0.1), which hand-made keys could hit and threefry's
    outputs hit with probability ~2^-32."""
    full = (*shape, 2) if bit_width == 64 else tuple(shape)
    words = int(np.prod(full, dtype=np.int64))
    if words > 2**32:
        raise ValueError(f"counter_hash draws at most 2^32 words per call, asked for {words} ({shape})")
    # The row-major index as a sum of per-axis iotas times strides (as jax's threefry does), not one long iota
    # reshaped: XLA then partitions it along every sharded axis, and each device builds only its own indices.
    index, stride = jnp.zeros(full, jnp.uint32), 1
    for axis in reversed(range(len(full))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, full, axis) * jnp.uint32(stride)
        stride *= full[axis]
    bits = _mix32(_mix32(index ^ key[0]) + key[1])
    if bit_width == 64:
        bits = bits.astype(jnp.uint64)
        return (bits[..., 0] << 32) | bits[..., 1]
    return bits.astype({8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bit_width])


_THREEFRY = jax.extend.random.threefry_prng_impl
COUNTER_HASH = jax.extend.random.define_prng_impl(
    key_shape=(2,), seed=_THREEFRY.seed, split=_THREEFRY.split, fold_in=_THREEFRY.fold_in,
    random_bits=_counter_hash_bits, name="counter_hash", tag="hash")
DROPOUT_RNGS = ("counter_hash", "threefry2x32", "rbg", "unsafe_rbg")


def dropout_rngs(key: jax.Array, rng_impl: str) -> nnx.Rngs:
    """The step's dropout streams, from a raw threefry key. counter_hash (default; see above) and threefry2x32
    give the same masks on any mesh; rbg and unsafe_rbg draw masks with XLA's RngBitGenerator, whose bits may
    change with the sharding, so a run is then reproducible only on the same mesh."""
    if rng_impl == "threefry2x32":
        return nnx.Rngs(dropout=key)
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):  # a typed key (jax_enable_custom_prng)
        key = jax.random.key_data(key)
    if rng_impl == "counter_hash":
        return nnx.Rngs(dropout=jax.random.wrap_key_data(key, impl=COUNTER_HASH))
    bits = jax.random.bits(key, (4,), jnp.uint32)  # an rbg key is 4 words
    return nnx.Rngs(dropout=jax.random.wrap_key_data(bits, impl=rng_impl))


def microbatches(batch: dict[str, jax.Array], num_microbatches: int) -> dict[str, jax.Array]:
    """[rows, ...] -> [num_microbatches, rows / num_microbatches, ...], microbatch m = rows m, m + M, m + 2M, ...:
    strided, so a device keeps its own rows of a batch split over the mesh (no resharding)."""
    def split(x):
        rows = x.shape[0]
        if rows % num_microbatches:
            raise ValueError(f"train.num_microbatches={num_microbatches} must divide the {rows} rows per batch")
        return x.reshape(rows // num_microbatches, num_microbatches, *x.shape[1:]).swapaxes(0, 1)
    return jax.tree.map(split, batch)


def gradients(params: PyTree, batch: dict[str, jax.Array], dropout_key: jax.Array, *, graphdef: nnx.GraphDef,
              label_smoothing: float, num_microbatches: int, rng_impl: str,
              objective: risk.Objective | None = None) -> tuple[PyTree, dict[str, jax.Array]]:
    """Gradient of the summed objective (step_metrics) and the metric sums, over num_microbatches sequential slices
    (lax.scan): sums add up exactly, so the caller's division by the token count equals the one-big-batch
    update. Microbatch m draws dropout from fold_in(dropout_key, m). A risk objective's candidates are drawn first,
    for the whole batch, from dropout_key (risk.draw_candidates), and split with their rows."""
    if objective is not None:
        batch = {**batch, "candidates": risk.draw_candidates(params, batch["inputs"], dropout_key, graphdef=graphdef,
                                                             candidates=objective.candidates,
                                                             length=batch["targets"].shape[1])}

    def loss_fn(params, batch, key):
        return step_metrics(nnx.merge(graphdef, params), batch, label_smoothing, deterministic=False,
                            rngs=dropout_rngs(key, rng_impl), mask_key=jax.random.fold_in(key, MASK_SALT),
                            objective=objective)

    grad_fn = jax.grad(loss_fn, has_aux=True)
    if num_microbatches == 1:
        return grad_fn(params, batch, dropout_key)

    def accumulate(carry, inputs):
        index, micro = inputs
        grads, metrics = grad_fn(params, micro, jax.random.fold_in(dropout_key, index))
        return jax.tree.map(jnp.add, carry, (grads, metrics)), None

    split = microbatches(batch, num_microbatches)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                         jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], split), dropout_key))
    (grads, metrics), _ = jax.lax.scan(accumulate, zeros, (jnp.arange(num_microbatches), split))
    return grads, metrics


def train_step(state: TrainState, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef,
               optimizer: optax.GradientTransformation, schedule: optax.Schedule, label_smoothing: float,
               num_microbatches: int = 1, rng_impl: str = "counter_hash", skip_nonfinite: bool = False,
               objective: risk.Objective | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
    """One Adam update on the mean smoothed loss per target token. Dropout key: fold_in(state.rng, step).

    metrics["nonfinite"] is 1 when the loss or the gradient norm is not finite: a flag that stays on the device
    until the loop's next fetch, so catching it costs no host sync. With skip_nonfinite such an update is not
    applied (parameters and optimizer state stay as they were; the step count and the data still advance)."""
    dropout_key = jax.random.fold_in(state.rng, state.step)
    grads, metrics = gradients(state.params, batch, dropout_key, graphdef=graphdef, label_smoothing=label_smoothing,
                               num_microbatches=num_microbatches, rng_impl=rng_impl, objective=objective)
    grads = jax.tree.map(lambda g: g / jnp.maximum(metrics["denominator"], 1.0), grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    if skip_nonfinite:
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), (params, opt_state),
                                         (state.params, state.opt_state))
    metrics.update(grad_norm=grad_norm, update_norm=optax.tree.norm(updates), param_norm=optax.tree.norm(params),
                   learning_rate=optim.learning_rate(schedule, state.step, state.opt_state),
                   nonfinite=1 - finite.astype(jnp.int32))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params: PyTree, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef,
              label_smoothing: float) -> dict[str, jax.Array]:
    return step_metrics(nnx.merge(graphdef, params), batch, label_smoothing, deterministic=True, rngs=None)[1]


def summarize(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Host-side: sum the SUM_KEYS over steps, average the rest, then per-token loss, accuracy, perplexity."""
    total = {key: float(np.sum([m[key] for m in metrics])) for key in metrics[0] if key in SUM_KEYS}
    means = {key: float(np.mean([m[key] for m in metrics])) for key in metrics[0] if key not in SUM_KEYS}
    denominator = max(total.get("denominator", 0.0), 1.0)
    summary = dict(means)
    summary.update(loss=total["loss"] / denominator, accuracy=total["correct"] / denominator,
                   perplexity=float(np.exp(min(total["nll"] / denominator, 50.0))),
                   target_tokens=total["denominator"], source_tokens=total["source_tokens"])
    summary.update({key: total[key] for key in ("encoder_pairs", "decoder_pairs", "cross_pairs") if key in total})
    summary.update({key: total[key] / denominator for key in ROUTER_STATS if key in total})
    if "sentences" in total:  # a risk objective's: per sentence
        summary.update(risk=total["risk"] / max(total["sentences"], 1.0),
                       reward=total["reward"] / max(total["sentences"], 1.0))
    return summary
