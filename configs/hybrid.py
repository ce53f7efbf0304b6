"""The hybrid state-space decoder on the built-in English->Spanish quick start: the decoder's self-attention is
Mamba-2's state-space mixer (model/ssm.py) in two layers of three and dense attention in the third (Jamba's and
Pitorro et al. 2024's hybrid), cross-attention kept in every layer. Trains, decodes with beam search and scores
BLEU on a CPU from one command:

    python train.py --config=configs/hybrid.py --workdir=runs/hybrid

Decoding carries, in each mixer layer, a state of heads x ssm_state x ssm_head_dim per hypothesis and the last
ssm_conv - 1 inputs of its convolution, whatever the length; the dense layer keeps its key/value cache. Any config
becomes hybrid the same way: --config.model.decoder_attention=ssm,ssm,dense (a pure state-space decoder: ssm);
decoder_only takes it too (docs/attention.md, "ssm").
"""

from configs import default


def get_config():
    config = default.get_config()
    config.model.decoder_attention = "ssm,ssm,dense"  # cycled over the decoder's 3 layers
    return config
