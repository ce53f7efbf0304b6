"""Train the Transformer: `python train.py --workdir=runs/demo [--config=configs/default.py] [--config.x.y=z]`.

Starting again on a workdir with checkpoints resumes the run from the latest one. The log (progress, evaluations,
the libraries' notices; transformer/console.py) goes to stderr, the final scores to stdout. Exit status: 0 done, 1
an error printed as `error: <message>` (--traceback for its traceback), 75 preempted (run the same command to
resume); see transformer/errors.py.
"""

import os
import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from transformer import config_files, console, errors, loop, sharding, trainer

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py")
if __name__ == "__main__":
    # Before DEFINE_config_file: without --config it applies the --config.* overrides at once, and an unknown key
    # would end in ml_collections' traceback rather than a message naming the nearest keys.
    with errors.messages():
        config_files.resolve_sys_argv(DEFAULT_CONFIG)
config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Config file (any field overridable).", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, vocabulary, logs and scores.", required=True)
sharding.define_distributed_flags()
flags.adopt_module_key_flags(sharding)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    console.route_libraries()  # absl's records (orbax, grain, the data pipeline) in the console's format
    with errors.as_config_error():  # every setting is checked before the devices or the workdir are touched
        trainer.Settings.from_config(flags.FLAGS.config)
    sharding.initialize_distributed(flags.FLAGS.coordinator_address, flags.FLAGS.num_processes,
                                    flags.FLAGS.process_id)
    result = trainer.Run(flags.FLAGS.config, flags.FLAGS.workdir).train()
    if "preempted" in result:  # the trainer has said which step it committed
        sys.exit(loop.EXIT_PREEMPTED)
    if jax.process_index() != 0:
        return
    for split, score in result.get("bleu", {}).items():  # a preempted run scored nothing
        print(f"{split} BLEU {score['bleu']:.2f}  {score['signature']}")
    for split, score in result.get("masked", {}).items():  # an encoder_only model's scores
        print(f"{split} masked accuracy {score['accuracy']:.4f}  perplexity {score['perplexity']:.3f}")


if __name__ == "__main__":
    app.run(errors.main_with_messages(main))
