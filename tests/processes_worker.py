"""One of two JAX processes on localhost (run by data_processes_test.py): builds its rows of the first
global batch from a token cache and prints what it saw as JSON."""

import json
import sys

import jax

process_id, port, cache_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id)

import numpy as np  # noqa: E402

from transformer import data, sharding, token_cache  # noqa: E402

shard = data.Shard.of_process()
cache = token_cache.TokenCache(cache_dir)
iterator = iter(data.train_dataset(cache, np.arange(len(cache)), seed=1, max_length=32, rows_per_batch=8,
                                   shard=shard))
local = next(iterator)
placed = sharding.place_local_batch(local)
print(json.dumps({
    "shard": [shard.index, shard.count], "global_shape": list(placed["targets"].shape),
    "local_rows": local["targets"].shape[0],
    "local_data_in_global": bool(np.array_equal(np.asarray(placed["targets"].addressable_shards[0].data),
                                                local["targets"])),
    "pairs": sorted({int(token) - 3 for token in local["targets"].ravel() if token})}))
jax.distributed.shutdown()
