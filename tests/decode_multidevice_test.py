"""Decoding split over 8 fake CPU devices gives the outputs of one device, in input order. Needs
XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts, so decode_devices_test.py runs this module
in a subprocess; in the ordinary 1-device session it is skipped."""

import decode_setup
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (run by decode_devices_test.py)")

from transformer import batching, decode, sharding  # noqa: E402
from transformer.model import build  # noqa: E402


def rows_over(devices) -> NamedSharding:
    return NamedSharding(Mesh(np.asarray(devices), ("data",)), PartitionSpec("data"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer = decode_setup.vocabulary(tmp_path_factory.mktemp("vocab"))
    graphdef, params = decode_setup.tiny_model()
    searches = decode_setup.make_searches(graphdef)
    one_device = decode_setup.decode_all(searches, params, tokenizer, rows_over(jax.devices()[:1]))
    return tokenizer, params, searches, one_device


def test_8_devices_decode_what_one_does_in_input_order(setup):
    tokenizer, params, searches, one_device = setup
    assert batching.device_rows(5, rows_over(jax.devices())) == 8
    # The default: every device, the params being on none.
    decode_setup.assert_same_hypotheses(decode_setup.decode_all(searches, params, tokenizer), one_device)
    # Reversed, each sentence lands in another row and batch: its hypotheses follow it (sampling's follow
    # its index, so only the searches).
    reversed_sentences = decode_setup.sentences(tokenizer)[::-1]
    for name in ("greedy", "beam"):
        ids = decode.search_sentences(searches[name], params, tokenizer, reversed_sentences, 5).best_ids()
        assert [x.tolist() for x in ids[::-1]] == [h[0][0] if h else [] for h in one_device[name]], name


def test_each_device_holds_its_own_rows_of_the_outputs(setup):
    tokenizer, params, searches, _ = setup
    batch_sharding = rows_over(jax.devices())
    [(_, inputs)] = batching.budget_batches(tokenizer.encode(decode_setup.sentences(tokenizer)[:8]), rows=8)
    streams = decode.default_streams(8)
    placed = sharding.place_batch({"inputs": inputs, "streams": np.asarray(streams)}, batch_sharding)
    sequences, _ = searches["beam"].run(params, placed["inputs"], placed["streams"])
    assert sorted(shard.device.id for shard in sequences.addressable_shards) == list(range(8))
    assert {shard.data.shape[0] for shard in sequences.addressable_shards} == {1} and sequences.shape[:2] == (8, 3)


def test_params_on_a_trainer_mesh_decode_on_its_batch_axes(setup):
    """(data, fsdp, expert, tensor) = (2, 2, 1, 2) over the devices in reverse order, parameters split by the trainer's
    rules: the default batch sharding is the params' mesh (a mesh of jax.devices() is refused by jit)."""
    tokenizer, params, searches, one_device = setup
    mesh_config = sharding.MeshConfig(2, 2, 2)
    mesh = Mesh(np.asarray(jax.devices()[::-1]).reshape(2, 2, 1, 2), sharding.MESH_AXES)
    abstract = nnx.eval_shape(lambda: build(decode_setup.MODEL, rngs=nnx.Rngs(0)))
    placed = jax.device_put(params, sharding.param_shardings(abstract, params, mesh, mesh_config))
    assert batching.batch_sharding_for(placed) == sharding.batch_sharding(mesh, mesh_config)  # what the trainer passes
    beam = {"beam": searches["beam"]}  # the search with the most state to split
    decode_setup.assert_same_hypotheses(decode_setup.decode_all(beam, placed, tokenizer), {"beam": one_device["beam"]})
    with pytest.raises(ValueError, match="incompatible devices"):
        decode.search_sentences(searches["greedy"], placed, tokenizer, ["A cat."], 8,
                                batch_sharding=rows_over(jax.devices()))


@pytest.mark.slow
def test_a_shrinking_batch_over_8_devices_decodes_what_one_device_does(setup):
    """decode.shrink=2: each batch of 8 rows (one per device) halves to 4 and 2 rows as its sentences finish; the
    gathered rows and the outputs scattered back give one device's hypotheses, in input order."""
    tokenizer, params, _, one_device = setup
    graphdef, _ = decode_setup.tiny_model()
    shrinking = {"greedy": decode.make_search(graphdef, max_extra_length=decode_setup.MAX_EXTRA_LENGTH, scores=True,
                                              shrink=2), "beam": decode_setup.shrinking_beam(graphdef)}
    decode_setup.assert_same_hypotheses(decode_setup.decode_all(shrinking, params, tokenizer, batch_size=8),
                                        {name: one_device[name] for name in shrinking})
