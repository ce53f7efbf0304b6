"""Transformer base on WMT14 English->French, with the paper's hyperparameters (Vaswani et al. 2017, Table 2).

    python scripts/prepare_wmt.py --config=configs/base_enfr.py --data_dir=$TFDS_DIR   # wmt14_translate/fr-en
    python train.py --config=configs/base_enfr.py --workdir=runs/base_enfr --config.data.tfds_data_dir=$TFDS_DIR

Paper: the base model and schedule of configs/base.py on the 36M sentence pairs of WMT14 English-French, with a
shared vocabulary of 32,000 word pieces (sentencepiece BPE here: sentencepiece has no word-piece model); dev
newstest2013, test newstest2014 (the full 3,003 sentences); 38.1 BLEU (tokenized).
"""

from configs import base


def use_enfr(config):
    """The data of the paper's English-French models: TFDS wmt14_translate/fr-en (examples keyed {'en', 'fr'})."""
    data = config.data
    data.tfds_name = "wmt14_translate/fr-en"
    data.source_lang, data.target_lang = "en", "fr"
    data.valid_split, data.test_split = "validation", "test"  # newstest2013, newstest2014
    data.vocab_size = 32_000
    data.vocab_model_type = "bpe"
    # The vocabulary is trained on a seeded sample of 5M of the 72M sentences (the split is spilled to disk
    # and sampled, never whole in memory): sentencepiece's trainer holds its sample in memory.
    data.vocab_max_sentences = 5_000_000
    return config


def get_config():
    return use_enfr(base.get_config())
