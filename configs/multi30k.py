"""Multi30k English->German on local text files: a small real-data recipe that trains on a CPU.

    python train.py --config=configs/multi30k.py:/path/to/multi30k --workdir=runs/multi30k

The folder holds line-aligned {train,val,test2016}.{en,de} (plain or .gz), one sentence per line, as
distributed at https://github.com/multi30k/dataset (data/task1/raw).
"""

from configs import default


def get_config(text_dir: str | None = None):
    config = default.get_config()
    data = config.data
    data.source = "text"
    data.text_dir = text_dir or ""  # or --config.data.text_dir=...
    data.source_lang, data.target_lang = "en", "de"
    data.train_split, data.valid_split, data.test_split = "train", "val", "test2016"
    data.vocab_size = 8000
    data.max_length = 64
    data.tokens_per_batch = 2048

    model = config.model
    model.emb_dim, model.mlp_dim, model.num_heads = 256, 1024, 4
    model.num_encoder_layers = model.num_decoder_layers = 3
    model.dropout_rate = 0.1

    config.optimizer.learning_rate_scale = 0.3  # peak lr ~1.5e-3 at 150 warmup steps for d_model 256
    config.optimizer.warmup_steps = 150
    config.train.num_train_steps = 3000
    config.train.eval_every_steps = 500
    config.train.checkpoint_every_steps = 500
    return config
