"""A decoder-only translation model, built-in English->Spanish: a language model over `source <sep> target`
(the loss on the target part only), bidirectional over the source prefix (model.prefix_lm), from the paper's
decoder layers without their cross-attention (docs/families.md). Trains, decodes with beam search and scores
BLEU on the built-in corpus on a CPU from one command:

    python train.py --config=configs/decoder_only.py --workdir=runs/decoder_only

Seven layers hold the default encoder-decoder's parameters (3 + 3 layers: an encoder layer is 4 d^2 + 2 d d_ff,
a decoder layer 8 d^2 + 2 d d_ff, a decoder-only layer 4 d^2 + 2 d d_ff), so the two compare at equal size.
Any encoder-decoder config becomes decoder-only the same way:
--config.model.family=decoder_only --config.model.num_encoder_layers=0 --config.model.num_decoder_layers=N.
"""

from configs import default


def get_config():
    config = default.get_config()
    model = config.model
    model.family = "decoder_only"
    model.num_encoder_layers = 0
    model.num_decoder_layers = 7
    return config
