"""One of two JAX processes on localhost (run by decode_devices_test.py): decodes decode_setup's sentences with
its searches (and a beam search whose batch shrinks across the processes' rows), the parameters replicated over
both processes' devices, and prints every hypothesis as JSON."""

import json
import sys

from transformer import sharding

process_id, port, vocab_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
sharding.initialize_distributed(f"localhost:{port}", 2, process_id)

import decode_setup  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

replicated = NamedSharding(Mesh(np.asarray(jax.devices()), ("data",)), PartitionSpec())
graphdef, params = decode_setup.tiny_model()
params = jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, replicated, lambda index: np.asarray(x)[index]),
                      params)
searches = decode_setup.make_searches(graphdef)
searches["shrinking beam"] = decode_setup.shrinking_beam(graphdef)
found = decode_setup.decode_all(searches, params, decode_setup.vocabulary(vocab_dir))
print(json.dumps({"processes": jax.process_count(), "devices": jax.device_count(), "hypotheses": found}))
jax.distributed.shutdown()
