"""The zero-setup quick start: a small Transformer on the built-in English->Spanish corpus, on a CPU.

    python train.py --workdir=runs/demo

The quick start is the project's defaults as they are: transformer/defaults.py holds every setting with its
default and meaning. The other configs start from this one and override. Override any field from the command
line: --config.model.num_encoder_layers=2 (an unknown key fails at once).
"""

import ml_collections

from transformer import defaults, sweep


def get_config() -> ml_collections.ConfigDict:
    return defaults.get_config()



# Shared by every point of the example sweep below: the quick start shrunk to 2.5-3 minutes per run on one
# CPU core (2+2 layers, d_ff 256, 1024 tokens per step, 400 steps on 20k pairs, 200-sentence dev and test sets,
# dev BLEU at steps 200 and 400). Not swept, so not in the run names.
SWEEP_SHARED = {
    "data.builtin_train_size": 20_000, "data.builtin_valid_size": 200, "data.builtin_test_size": 200,
    "data.tokens_per_batch": 1024, "model.num_encoder_layers": 2, "model.num_decoder_layers": 2,
    "model.mlp_dim": 256, "train.num_train_steps": 400, "train.eval_every_steps": 100,
    "train.bleu_every_steps": 200, "train.checkpoint_every_steps": 200,
}


def get_sweep() -> list[dict]:
    """The example sweep: warmup x dropout x label smoothing, 8 points, each with SWEEP_SHARED. 11m09s on
    2 CPU cores (docs/sweeps.md):

        python scripts/sweep.py --config=configs/default.py --sweep_dir=runs/sweep --parallel=2
    """
    return sweep.product([SWEEP_SHARED], sweep.axis("optimizer.warmup_steps", [100, 400]),
                         sweep.axis("model.dropout_rate", [0.0, 0.1]), sweep.axis("train.label_smoothing", [0.0, 0.1]))
