"""Run by startup_test.py in a process with N fake CPU devices: the start-up path of train.py (settings, mesh,
batch plan, shardings, the abstract state, and the train step traced under jax.eval_shape) for every config in
configs/ on the meshes the README shows. Prints one JSON line per (config, mesh); compiles nothing."""

import glob
import importlib
import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformer.plan import make_steps, startup_plan
from transformer.settings import Settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = {"data": dict(data=-1), "fsdp": dict(data=1, fsdp=-1), "fsdp_tensor": dict(data=1, fsdp=-1, tensor=2)}


def load(name):
    module = importlib.import_module(f"configs.{name}")
    return module.get_config("/some/text/dir") if name in ("multi30k", "multi30k_bt", "europarl") else module.get_config()


def main():
    names = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                   if not os.path.basename(p).startswith("_"))
    for name in names:
        for mesh_name, sizes in MESHES.items():
            config = load(name)
            config.mesh.update({"data": 1, "fsdp": 1, "tensor": 1, **sizes})
            settings = Settings.from_config(config)
            plan, note = startup_plan(settings)
            state = plan.abstract_state(settings.seed)
            record = {"config": name, "mesh": mesh_name, "mesh_shape": dict(plan.mesh.shape),
                      "rows": plan.batch.rows, "row_length": plan.batch.row_length, "tokens": plan.batch.tokens,
                      "asked_rows": settings.data.rows_per_batch, "note": note,
                      "local_rows": plan.batch_sharding.shard_shape((plan.batch.rows, plan.batch.row_length))[0],
                      "params_split": any(x.sharding.shard_shape(x.shape) != x.shape
                                          for x in jax.tree.leaves(state.params))}
            if mesh_name == "fsdp_tensor":  # tracing does not depend on the mesh: once per config
                train, _ = make_steps(plan.graphdef, plan.optimizer, plan.schedule, settings.train,
                                              plan.state_shardings, plan.batch_sharding)
                new_state, metrics = jax.eval_shape(train, state, plan.abstract_batch())
                record["step_traced"] = (jax.tree.structure(new_state) == jax.tree.structure(state)
                                         and "loss" in metrics)
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
