"""Prepare TFDS translation datasets (e.g. wmt14_translate/de-en) in array_record format, for training
with `data.source=tfds` (read by `tfds.data_source`, no TensorFlow needed at training time).

Run it once on a machine with internet access; copy or mount the data_dir where training runs:

    python scripts/prepare_wmt.py --data_dir=/data/tfds                             # wmt14_translate/de-en
    python scripts/prepare_wmt.py --data_dir=/data/tfds --datasets=wmt14_translate/de-en,wmt17_translate/de-en
    python scripts/prepare_wmt.py --data_dir=/data/tfds --config=configs/base_enfr.py  # what that config reads
    python scripts/prepare_wmt.py --data_dir=/data/tfds --dry_run                   # what it would do; no download

Direction: a WMT config names a language pair, not a direction (wmt14_translate/de-en holds examples
{'de': ..., 'en': ...}); the training config chooses it with data.source_lang / data.target_lang.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

flags.DEFINE_string("data_dir", None, "TFDS data directory to prepare into (training's data.tfds_data_dir).")
flags.DEFINE_list("datasets", ["wmt14_translate/de-en"], "TFDS translation configs, comma-separated.")
flags.DEFINE_string("config", None, "A training config (e.g. configs/base_enfr.py): prepare the TFDS dataset it "
                    "reads (its data.tfds_name) instead of --datasets.")
flags.DEFINE_string("download_dir", None, "Where raw downloads go (default: <data_dir>/downloads).")
flags.DEFINE_bool("dry_run", False, "Print each dataset's subsets, splits and sizes (as far as TFDS knows them "
                  "without downloading), and the command it would run; download nothing.")
FLAGS = flags.FLAGS


class PrepareError(ValueError):
    """A dataset name or directory that cannot be prepared as asked."""


def check_args(data_dir: str | None, datasets: list[str]) -> list[str]:
    """The dataset names, validated before anything is downloaded."""
    if not data_dir:
        raise PrepareError("--data_dir is required: the TFDS data directory to prepare into")
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise PrepareError(f"--data_dir={data_dir} exists and is not a directory")
    names = [name.strip() for name in datasets if name.strip()]
    if not names:
        raise PrepareError("--datasets is empty; e.g. --datasets=wmt14_translate/de-en")
    for name in names:
        if "/" not in name:
            raise PrepareError(f"--datasets names {name!r} without a config; translation datasets need one "
                               f"language pair, e.g. {name}/de-en")
    return names


def config_dataset(config_path: str) -> str:
    """The TFDS dataset a training config reads, or a PrepareError when it reads none."""
    from transformer import config_files, errors, sweep_runner

    try:
        config = sweep_runner.load_config(config_files.find(config_path))
    except errors.ConfigError as error:
        raise PrepareError(str(error)) from error
    if config.data.source != "tfds" or not config.data.tfds_name:
        raise PrepareError(f"--config={config_path} reads data.source={config.data.source!r}, not a TFDS "
                           "dataset: there is nothing to prepare")
    return config.data.tfds_name


def builder_for(name: str, data_dir: str):
    """The TFDS builder of `name`, or a PrepareError naming the unknown dataset or config."""
    from transformer import sources  # imports tensorflow_datasets with the WMT builders registered

    tfds = sources._import_tfds()  # pylint: disable=protected-access
    try:
        return tfds.builder(name, data_dir=data_dir)
    except Exception as error:  # pylint: disable=broad-except
        configs = sources._available_configs(tfds, name)  # pylint: disable=protected-access
        hint = f" (available configs: {', '.join(configs)})" if configs else ""
        raise PrepareError(f"cannot build TFDS dataset {name!r}: {error}{hint}") from error


def describe(builder) -> str:
    """What TFDS knows about a dataset before it is downloaded."""
    info, config = builder.info, builder.builder_config
    lines = [f"{builder.name}/{config.name} version {builder.version}: languages "
             f"{getattr(config, 'language_pair', info.supervised_keys)}",
             f"  download size: {info.download_size}; prepared size: {info.dataset_size}"
             + (" (TFDS knows them only from a prepared copy's metadata)" if not info.splits else "")]
    subsets_by_split = getattr(builder, "subsets", None) or getattr(config, "subsets", None) or {}
    for split, subsets in sorted(subsets_by_split.items(), key=lambda item: str(item[0])):
        lines.append(f"  {split}: {', '.join(subset for subset in subsets)}")
    lines.append(f"  prepared already: {builder.is_prepared()} ({builder.data_dir})")
    return "\n".join(lines)


def prepare(builder, download_dir: str | None) -> None:
    import tensorflow_datasets as tfds

    config = tfds.download.DownloadConfig(download_dir=download_dir) if download_dir else None
    builder.download_and_prepare(file_format="array_record", download_config=config)


def main(argv):
    del argv
    if FLAGS.config and FLAGS["datasets"].present:
        raise PrepareError("--config and --datasets both name what to prepare: give one")
    names = check_args(FLAGS.data_dir, [config_dataset(FLAGS.config)] if FLAGS.config else FLAGS.datasets)
    builders = [builder_for(name, FLAGS.data_dir) for name in names]  # every name checked before any download
    for name, builder in zip(names, builders):
        print(describe(builder))
        if FLAGS.dry_run:
            print(f"  would run: tfds.builder({name!r}, data_dir={FLAGS.data_dir!r})"
                  ".download_and_prepare(file_format='array_record')")
        elif builder.is_prepared():
            print("  already prepared; nothing to do")
        else:
            prepare(builder, FLAGS.download_dir)
            print(f"  prepared: {builder.info.splits}")


if __name__ == "__main__":
    try:
        app.run(main)
    except PrepareError as error:
        sys.exit(f"prepare_wmt.py: {error}")
