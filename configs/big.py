"""Transformer big on WMT14 English->German, with the paper's hyperparameters (Table 3, "big").

    python train.py --config=configs/big.py --workdir=runs/big --config.data.tfds_data_dir=/path/to/tfds

Paper: d_model 1024, d_ff 4096, 16 heads, P_drop 0.3 (en-de), 300k steps; everything else as base;
the last 20 checkpoints averaged; 28.4 BLEU on newstest2014.
"""

from configs import base


def get_config():
    config = base.get_config()
    config.model.emb_dim, config.model.mlp_dim, config.model.num_heads = 1024, 4096, 16
    config.model.dropout_rate = 0.3
    config.train.num_train_steps = 300_000
    config.decode.average_last = 20  # the paper averages the last 20 checkpoints of big (params snapshots)
    return config
