"""Fine-tune a workdir, trained here or imported (scripts/import_hf.py): a new run with that run's settings
(its model, vocabulary, data, decoding) that starts from its latest parameters with a fresh optimizer, schedule
and data position (train.init_from), as fairseq's --restore-file --reset-optimizer --reset-dataloader, t5x's
initial_checkpoint_path and Marian's --pretrained-model do.

    python train.py --config=configs/finetune.py:runs/opus-en-de --workdir=runs/opus-ft \
        --config.data.source=text --config.data.text_dir=$DATA/multi30k --config.data.valid_split=val \
        --config.train.num_train_steps=300

The argument is the workdir (WORKDIR:STEP, WORKDIR:best or WORKDIR:avgK name its checkpoints as train.init_from
does). Override the data to fine-tune on, and the steps and learning rate: the schedule starts again from its
warmup. The model settings must stay the source's (its dropout rates, dtype and the like may change).
"""

import json
import os

from transformer import defaults
from transformer.restore import InitFrom


def get_config(source: str | None = None):
    config = defaults.get_config()
    if not source:  # listed without an argument (tests, config listings): the defaults, no warm start
        return config
    with open(os.path.join(InitFrom.parse(source).workdir, "config.json"), encoding="utf-8") as handle:
        saved = json.load(handle)
    for section, values in saved.items():
        if section in config and isinstance(values, dict):
            config[section].update({key: value for key, value in values.items() if key in config[section]})
        elif section in config:
            config[section] = values
    config.data.vocab_path = ""  # train.init_from gives the source's vocabulary
    config.train.init_from = source
    return config
