"""A low-resource news check: train English->German on 20k pairs of Europarl (a slice of WMT14's training
text), choose and score on newstest2013 (the paper's dev set). Same recipe as configs/multi30k.py, with
rows long enough for parliament speeches.

    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python train.py --config=configs/europarl.py:/path/to/data \
        --workdir=runs/europarl

The folder holds europarl-20k/europarl-v7-first20k.{en,de} and wmt14-dev/newstest2013.{en,de}
(line-aligned text; newstest2013 from https://www.statmt.org/wmt14/dev.tgz, sgm tags stripped).
"""

from configs import multi30k


def get_config(data_dir: str | None = None):
    config = multi30k.get_config(data_dir)
    data = config.data
    data.train_split = "europarl-20k/europarl-v7-first20k"  # paths under text_dir
    data.valid_split = "wmt14-dev/newstest2013"
    data.test_split = "wmt14-dev/newstest2013"  # no separate test here: nothing is chosen on it but it is the dev set
    data.max_length = 128
    data.tokens_per_batch = 4096  # 32 rows of 128
    config.train.max_train_minutes = 20.0
    config.decode.bleu_splits = "valid"  # newstest2013 only
    config.decode.batch_size = 128
    return config
