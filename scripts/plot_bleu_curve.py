"""Dev BLEU against training time (the time-to-BLEU curve) of one or more workdirs, from their metrics.jsonl.

    python scripts/plot_bleu_curve.py --workdirs=runs/multi30k --output=docs/multi30k_bleu_vs_time.png

Each point is a dev (valid split) BLEU written during training, at the training seconds spent by then
(compilation and evaluation excluded); the end-of-run score of the averaged checkpoints is drawn as a star.
The test split is never drawn: it is not used to choose anything. Needs the `plot` extra (matplotlib).
"""

import json
import os

from absl import app, flags


def curve(workdir: str) -> tuple[list[tuple[float, float, int]], list[tuple[float, float, int]]]:
    """([(minutes, bleu, step)] of valid BLEU during training, [(minutes, bleu, step)] of the averaged end)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: is {workdir} a training workdir?")
    points, averaged = [], []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if record.get("split") in ("valid_bleu", "avg_valid_bleu") and "train_seconds" in record:
                point = (record["train_seconds"] / 60, record["bleu"], record["step"])
                (points if record["split"] == "valid_bleu" else averaged).append(point)
    if not points and not averaged:
        raise ValueError(f"{path} holds no valid BLEU with train_seconds (train with train.bleu_every_steps > 0)")
    return points, averaged


def main(argv):
    del argv
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for workdir in flags.FLAGS.workdirs:
        points, averaged = curve(workdir)
        label = os.path.basename(os.path.normpath(workdir))
        line = axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)[0]
        if averaged:
            axes.plot([p[0] for p in averaged], [p[1] for p in averaged], marker="*", markersize=12, linestyle="",
                      color=line.get_color(), label=f"{label}, last checkpoints averaged")
        for minutes, bleu, step in points + averaged:
            print(f"{label}\tstep {step}\t{minutes:.1f} min\tvalid BLEU {bleu:.2f}")
    axes.set_xlabel("training time (minutes; compilation and evaluation excluded)")
    axes.set_ylabel("dev BLEU (sacreBLEU)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(flags.FLAGS.output, dpi=120)
    print("wrote", flags.FLAGS.output)


if __name__ == "__main__":
    flags.DEFINE_list("workdirs", None, "Training workdirs (comma-separated).", required=True)
    flags.DEFINE_string("output", "bleu_vs_time.png", "PNG to write.")
    app.run(main)
