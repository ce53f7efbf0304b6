"""An encoder-only masked language model, built-in English->Spanish pairs: BERT's objective (15% of the tokens
chosen, 80% of them masked, 10% replaced at random, 10% kept) over each pair joined into one row (XLM's
translation language modelling: model.masked_side='both'), from the paper's encoder layers (docs/families.md).
Trains on the built-in corpus on a CPU from one command, and reports masked-token accuracy and perplexity on
valid and test (no BLEU: it has no decoder):

    python train.py --config=configs/encoder_only.py --workdir=runs/encoder_only

Its checkpoint loads as a feature extractor: transformer.features.FeatureExtractor(workdir) returns the
encoder's outputs for sentences. model.masked_side='source' or 'target' reads and masks one side alone.
"""

from configs import default


def get_config():
    config = default.get_config()
    model = config.model
    model.family = "encoder_only"
    model.masked_side = "both"
    model.num_encoder_layers = 3
    model.num_decoder_layers = 0
    return config
