"""Transformer base on WMT14 English->German, with the paper's hyperparameters (Vaswani et al. 2017, Table 3).

    python scripts/prepare_wmt.py ... (or `tfds build wmt14_translate/de-en`), then
    python train.py --config=configs/base.py --workdir=runs/base --config.data.tfds_data_dir=/path/to/tfds

Paper: 6+6 layers, d_model 512, d_ff 2048, 8 heads, P_drop 0.1, eps_ls 0.1, Adam(0.9, 0.98, 1e-9), warmup
4000, 100k steps of about 25k source + 25k target tokens, a shared byte-pair vocabulary of about 37k tokens
(sentencepiece's BPE here; the README says how it differs from the paper's subword-nmt); dev newstest2013, test
newstest2014; 27.3 BLEU (tokenized, compound-split).
"""

from configs import default
from transformer import sweep


def get_config():
    config = default.get_config()
    data = config.data
    data.source = "tfds"
    data.tfds_name = "wmt14_translate/de-en"  # examples keyed {'de', 'en'}; the direction is set below
    data.source_lang, data.target_lang = "en", "de"
    data.train_split = "train"
    data.valid_split = "validation"  # newstest2013
    data.test_split = "test"  # newstest2014
    data.vocab_size = 37_000
    data.vocab_model_type = "bpe"
    data.vocab_max_sentences = 10_000_000
    data.max_length = 256
    # 96 packed rows of 256 (~24k real tokens a side at 98% packing, the paper's "approximately 25000"): 96 rows split
    # whole over 1 to 32 batch-axis devices; 64 or more get the nearest multiple, said in one log line.
    data.tokens_per_batch = 24_576

    model = config.model
    model.emb_dim, model.mlp_dim, model.num_heads = 512, 2048, 8
    model.num_encoder_layers = model.num_decoder_layers = 6
    model.dropout_rate = 0.1
    model.attention_dropout_rate = model.relu_dropout_rate = 0.0  # the paper names residual dropout only
    model.positional_encoding, model.layer_norm = "sinusoidal", "post"
    model.share_embeddings = model.tie_output_embedding = True

    optimizer = config.optimizer
    optimizer.learning_rate_scale = 1.0
    optimizer.warmup_steps = 4000
    optimizer.adam_b1, optimizer.adam_b2, optimizer.adam_eps = 0.9, 0.98, 1e-9

    train = config.train
    train.num_train_steps = 100_000
    train.label_smoothing = 0.1
    train.log_every_steps = 100
    train.eval_every_steps = 1000
    train.bleu_every_steps = 10_000
    train.checkpoint_every_minutes = 10  # the paper wrote its checkpoints at 10-minute intervals
    train.checkpoint_every_steps = 10_000  # and by steps as a floor
    train.keep_checkpoints = 2  # train states for resuming; averaging reads the params snapshots below

    train.keep_best_checkpoint = True  # chosen on newstest2013 (valid) BLEU

    decode = config.decode
    decode.batch_size = 128
    decode.beam_size, decode.alpha = 4, 0.6  # the paper's beam search
    decode.max_extra_length = 50  # input length + 50
    decode.average_last = 5  # the last 5 checkpoints' params are kept and averaged, as the paper did for base
    return config


def get_sweep() -> list[dict]:
    """The model-size grid commonly tried: num_heads {8, 12, 16} x d_model {512, 768, 1024} x dropout {0.1, 0.2},
    with d_ff = 4 d_model moving together with d_model (zip), as in both of the paper's models. 18 points, of
    which 4 are invalid: 12 heads divide neither 512 nor 1024. The sweep refuses to start unless --skip_invalid:

        python scripts/sweep.py --config=configs/base.py --sweep_dir=runs/grid --skip_invalid --emit=slurm
    """
    return sweep.product(sweep.axis("model.num_heads", [8, 12, 16]),
                         sweep.zip(sweep.axis("model.emb_dim", [512, 768, 1024]),
                                   sweep.axis("model.mlp_dim", [2048, 3072, 4096])),
                         sweep.axis("model.dropout_rate", [0.1, 0.2]))
