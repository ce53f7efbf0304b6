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
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

PyTree = Any
SUM_KEYS = ("loss", "nll", "correct", "denominator", "source_tokens")  # summed over batches and steps


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
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab_size - 1)
    entropy = -(confidence * jnp.log(confidence) + (vocab_size - 1) * low * jnp.log(low + 1e-20))
    soft_targets = jax.nn.one_hot(targets, vocab_size) * (confidence - low) + low
    return -jnp.sum(soft_targets * jax.nn.log_softmax(logits), axis=-1) - entropy


def token_metrics(logits: jax.Array, batch: dict[str, jax.Array], label_smoothing: float) -> dict[str, jax.Array]:
    """Sums over non-padding target tokens: smoothed loss, plain negative log-likelihood, correct argmax."""
    targets = batch["targets"]
    weights = (targets != 0).astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
    return {
        "loss": jnp.sum(label_smoothed_cross_entropy(logits, targets, label_smoothing) * weights),
        "nll": jnp.sum(nll * weights),
        "correct": jnp.sum((jnp.argmax(logits, axis=-1) == targets) * weights),
        "denominator": jnp.sum(weights),
        "source_tokens": jnp.sum(batch["inputs"] != 0).astype(jnp.float32),
    }


def forward(model: nnx.Module, batch: dict[str, jax.Array], *, deterministic: bool,
            rngs: nnx.Rngs | None) -> jax.Array:
    """Teacher-forced logits [batch, length, vocab] for a (possibly packed) batch."""
    targets_segmentation = batch.get("targets_segmentation")
    return model(batch["inputs"], shift_right(batch["targets"], targets_segmentation),
                 inputs_segmentation=batch.get("inputs_segmentation"), inputs_position=batch.get("inputs_position"),
                 targets_segmentation=targets_segmentation, targets_position=batch.get("targets_position"),
                 deterministic=deterministic, rngs=rngs)


def train_step(state: TrainState, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef,
               optimizer: optax.GradientTransformation, schedule: optax.Schedule,
               label_smoothing: float) -> tuple[TrainState, dict[str, jax.Array]]:
    """One Adam update on the mean smoothed loss per target token. Dropout key: fold_in(state.rng, step)."""
    dropout_key = jax.random.fold_in(state.rng, state.step)

    def loss_fn(params):
        model = nnx.merge(graphdef, params)
        logits = forward(model, batch, deterministic=False, rngs=nnx.Rngs(dropout=dropout_key))
        metrics = token_metrics(logits, batch, label_smoothing)
        return metrics["loss"] / jnp.maximum(metrics["denominator"], 1.0), metrics

    grads, metrics = jax.grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics.update(grad_norm=optax.tree.norm(grads), update_norm=optax.tree.norm(updates),
                   param_norm=optax.tree.norm(params), learning_rate=schedule(state.step))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params: PyTree, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef,
              label_smoothing: float) -> dict[str, jax.Array]:
    model = nnx.merge(graphdef, params)
    return token_metrics(forward(model, batch, deterministic=True, rngs=None), batch, label_smoothing)


def summarize(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Host-side: sum the SUM_KEYS over steps, average the rest, then per-token loss, accuracy, perplexity."""
    total = {key: float(np.sum([m[key] for m in metrics])) for key in metrics[0] if key in SUM_KEYS}
    means = {key: float(np.mean([m[key] for m in metrics])) for key in metrics[0] if key not in SUM_KEYS}
    denominator = max(total.get("denominator", 0.0), 1.0)
    summary = dict(means)
    summary.update(loss=total["loss"] / denominator, accuracy=total["correct"] / denominator,
                   perplexity=float(np.exp(min(total["nll"] / denominator, 50.0))),
                   target_tokens=total["denominator"], source_tokens=total["source_tokens"])
    return summary
