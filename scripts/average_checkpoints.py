"""Write the average of the last N checkpoints of a workdir as a new workdir that eval.py and
transformer.translate read like any other (the paper averaged the last 5 checkpoints of base, 20 of big).

    python scripts/average_checkpoints.py --workdir=runs/base --average_last=5 --output_workdir=runs/base_avg5
    python eval.py --workdir=runs/base_avg5

The new workdir gets config.json, vocab.model, run.json and checkpoints/<last step>: the mean of the parameters only (what
evaluation reads; it cannot resume training). An existing, non-empty --output_workdir is refused.
"""

import os

from absl import app, flags

from transformer import console, files
from transformer.restore import restore
from transformer.workdir import CONFIG_FILE, RUN_FILE
from transformer.checkpoint import Checkpointer


def define_flags() -> None:
    """Defined only when run as a script, so that tests can import several scripts into one process."""
    flags.DEFINE_string("workdir", None, "A directory written by train.py.", required=True)
    flags.DEFINE_integer("average_last", None, "How many of the last checkpoints to average.", required=True)
    flags.DEFINE_integer("step", None, "Average the last N checkpoints up to this step (default: the latest).")
    flags.DEFINE_string("output_workdir", None, "The new workdir to write (must not exist, or be empty).", required=True)


FLAGS = flags.FLAGS


def write_averaged_workdir(workdir: str, output_workdir: str, average_last: int, step: int | None = None) -> list[int]:
    """Average and write; returns the averaged steps. Everything is checked before output_workdir is created."""
    if average_last < 1:
        raise ValueError(f"--average_last={average_last} must be >= 1")
    if files.exists(output_workdir) and (not files.is_dir(output_workdir) or files.list_dir(output_workdir)):
        raise FileExistsError(f"--output_workdir={output_workdir} exists and is not empty; choose a new directory")
    restored = restore(workdir, step, average_last=average_last)  # every check and message lives here
    steps = restored.averaged_steps or [restored.step]
    settings = restored.settings
    files.make_dirs(output_workdir)
    files.copy_file(os.path.join(workdir, CONFIG_FILE), os.path.join(output_workdir, CONFIG_FILE))
    for name in ("vocab.model", RUN_FILE):  # the vocabulary, and the record eval checks it against
        if files.exists(os.path.join(workdir, name)):
            files.copy_file(os.path.join(workdir, name), os.path.join(output_workdir, name))
    target = Checkpointer(os.path.join(output_workdir, "checkpoints"), save_every_steps=1, keep=1, use_async=False)
    target.save(steps[-1], {"params": restored.params}, force=True)  # what evaluation reads
    target.wait()
    target.close()
    return steps


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    console.route_libraries()  # absl's records (orbax, grain, the data pipeline) in the console's format
    steps = write_averaged_workdir(FLAGS.workdir, FLAGS.output_workdir, FLAGS.average_last, FLAGS.step)
    print(f"wrote the average of steps {steps} to {FLAGS.output_workdir}/checkpoints/{steps[-1]}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
