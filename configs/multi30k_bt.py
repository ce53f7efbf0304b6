"""Multi30k English->German with back-translated German (Sennrich et al. 2016): the Multi30k recipe trained on a
mixture of its parallel text and a synthetic corpus whose English side a de->en model wrote, tagged (Caswell et
al. 2019). The three commands (README, "Data: mixtures, cleaning and back-translation"):

    python train.py --config=configs/multi30k.py:$DATA/multi30k --config.data.source_lang=de \
        --config.data.target_lang=en --workdir=runs/multi30k_de_en              # 1. the reverse model
    python -m transformer.back_translate --workdir=runs/multi30k_de_en --input=mono.de \
        --output_dir=runs/bt_de --temperature=1                                 # 2. sampled back-translation
    python train.py --config=configs/multi30k_bt.py:$DATA/multi30k,runs/bt_de --workdir=runs/multi30k_bt  # 3.

The argument is the Multi30k folder, holding {train,val,test2016}.{en,de} as for configs/multi30k.py, and the
back-translation folder, holding the train.en and train.de that step 2 writes, comma-separated. The synthetic corpus gets
weight 0.5 against Multi30k's 1 (a third of the training pairs), a first choice, not tuned on val; change it with
--config.data.mixture="1:main,W:synthetic:runs/bt_de". Everything else is configs/multi30k.py's.
"""

from configs import multi30k


def get_config(folders: str | None = None):
    text_dir, _, synthetic_dir = (folders or ",").partition(",")
    config = multi30k.get_config(text_dir)
    config.data.mixture = f"1:main,0.5:synthetic:{synthetic_dir}" if synthetic_dir else ""
    config.data.tag_synthetic = True  # the <bt> tag before every synthetic source
    return config
