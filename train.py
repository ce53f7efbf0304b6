"""Train the Transformer: `python train.py --workdir=runs/demo [--config=configs/default.py] [--config.x.y=z]`.

Starting again on a workdir with checkpoints resumes the run from the latest one.
"""

import os

from absl import app, flags, logging
from ml_collections import config_flags

from transformer import trainer

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py")
config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Config file (any field overridable).", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, vocabulary, logs and scores.", required=True)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO; --verbosity=0 shows it
        logging.set_verbosity(logging.WARNING)
    result = trainer.Run(flags.FLAGS.config, flags.FLAGS.workdir).train()
    for split, score in result["bleu"].items():
        print(f"{split} BLEU {score['bleu']:.2f}  {score['signature']}")


if __name__ == "__main__":
    app.run(main)
