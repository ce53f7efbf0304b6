"""Incremental decoding with the model's key/value caches. Greedy search here; beam search has its own issue.

`greedy_search` is a pure function of (params, inputs), jitted once per input shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer import data
from transformer.metrics import log
from transformer.tokenizer import EOS_ID, PAD_ID, Tokenizer

PyTree = Any


def greedy_search(params: PyTree, inputs: jax.Array, *, graphdef: nnx.GraphDef, max_extra_length: int) -> jax.Array:
    """inputs [batch, src_length] -> output ids [batch, src_length + max_extra_length], padded with 0 after EOS.

    Stops early once every row has produced EOS (rows of all-padding inputs count as finished).
    """
    model = nnx.merge(graphdef, params)
    batch, max_decode_length = inputs.shape[0], inputs.shape[1] + max_extra_length
    cache = model.init_cache(model.encode(inputs), max_decode_length)
    outputs = jnp.zeros((batch, max_decode_length), jnp.int32)
    finished = jnp.all(inputs == 0, axis=1)

    def not_done(carry):
        index, _, _, finished, _ = carry
        return (index < max_decode_length) & ~jnp.all(finished)

    def step(carry):
        index, previous, cache, finished, outputs = carry
        logits, cache = model.decode_step(previous, index, cache, inputs)
        token = jnp.where(finished, PAD_ID, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        outputs = outputs.at[:, index].set(token)
        return index + 1, token, cache, finished | (token == EOS_ID), outputs

    start = (jnp.int32(0), jnp.zeros((batch,), jnp.int32), cache, finished, outputs)
    return jax.lax.while_loop(not_done, step, start)[-1]


def make_greedy_search(graphdef: nnx.GraphDef, max_extra_length: int) -> Callable[[PyTree, jax.Array], jax.Array]:
    """`greedy_search` bound to one model and jitted: `search(params, inputs) -> output ids`."""
    return jax.jit(functools.partial(greedy_search, graphdef=graphdef, max_extra_length=max_extra_length))


def translate(search: Callable[[PyTree, jax.Array], jax.Array], params: PyTree, tokenizer: Tokenizer,
              sentences: list[str], batch_size: int, max_input_length: int | None = None) -> list[str]:
    """Translate sentences in length-sorted batches with a jitted `search(params, inputs)`; keeps input order.

    An empty sentence gets an empty translation. With `max_input_length` (a model with learned positions),
    longer inputs are truncated to it, keeping their EOS, with a warning.
    """
    if not sentences:
        return []
    inputs = tokenizer.encode(sentences)
    if max_input_length is not None:
        too_long = [i for i, ids in enumerate(inputs) if len(ids) > max_input_length]
        if too_long:
            log.warning("truncating %d input(s) longer than the model's %d positions (first: line %d)",
                        len(too_long), max_input_length, too_long[0] + 1)
            for i in too_long:
                inputs[i] = np.append(inputs[i][:max_input_length - 1], EOS_ID).astype(np.int32)
    translations: list[str] = [""] * len(sentences)
    for indices, batch in data.decode_batches(inputs, batch_size):
        outputs = np.asarray(search(params, batch))
        for index, ids in zip(indices, outputs):
            if index >= 0 and sentences[index].strip():
                translations[index] = tokenizer.decode(ids)
    return translations
