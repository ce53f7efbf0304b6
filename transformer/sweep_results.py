"""Collecting a sweep (transformer/sweep_runner.py) into results.csv, results.md and results.png: one row per run
from sweep.json and each run's workdir, whatever state the runs are in.
"""

from __future__ import annotations

import builtins
import csv
import io
import os
import time
from typing import Any, Callable

from transformer import files, metrics
from transformer.sweep import SweepError
from transformer.sweep_runner import MANIFEST, format_seconds, is_complete, name_value, run_state


def read_metrics(workdir: str) -> dict[str, dict[int, dict]]:
    """metrics.jsonl as {split: {step: record}}. A resumed run appends again from its checkpoint, so the
    last record of a step wins; a half-written last line (a run still writing) is skipped."""
    records: dict[str, dict[int, dict]] = {}
    for record in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl")):
        records.setdefault(record.get("split", ""), {})[int(record.get("step", 0))] = record
    return records


def _last(records: dict[int, dict], key: str):
    return records[max(records)].get(key) if records else None


def run_row(workdir: str, target: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list]]:
    """One run's results and its curves (loss and dev BLEU against steps). A run that ended at its `target`
    (its step count, or its time budget first) is reported by its final scores (scores.json: the averaged last
    checkpoints, decoded with the run's search), any other by its latest in-training figures."""
    num_train_steps = target["num_train_steps"]
    records = read_metrics(workdir)
    train, valid = records.get("train", {}), records.get("valid", {})
    dev_bleu, test_bleu = records.get("valid_bleu", {}), records.get("test_bleu", {})
    scores = files.read_json(os.path.join(workdir, "scores.json"), None, cache=True) or {}
    complete = is_complete(workdir, target)
    bleu = scores.get("bleu", {}) if complete else {}
    tokens = sum(r.get("target_tokens", 0) for r in train.values())
    seconds = sum(r["target_tokens"] / r["tokens_per_second"] for r in train.values()
                  if r.get("tokens_per_second") and r.get("target_tokens"))
    row = {
        "dev_bleu": bleu.get("valid", {}).get("bleu", _last(dev_bleu, "bleu")),
        "best_dev_bleu": max((r["bleu"] for r in dev_bleu.values() if "bleu" in r), default=None),
        "test_bleu": bleu.get("test", {}).get("bleu", _last(test_bleu, "bleu")),
        "train_loss": _last(train, "loss"),
        "dev_loss": (scores.get("valid", {}) if complete else {}).get("loss", _last(valid, "loss")),
        # exp(unsmoothed NLL): the loss includes label smoothing, so only this compares across its values
        "dev_perplexity": (scores.get("valid", {}) if complete else {}).get("perplexity", _last(valid, "perplexity")),
        "step": scores["step"] if complete else (max(train) if train else None),
        "num_train_steps": num_train_steps,
        # Which figures dev_bleu and test_bleu are: the run's final scores, or its latest in training.
        "scored": "final" if complete and bleu else ("in training" if dev_bleu or test_bleu else ""),
        "tokens_per_second": tokens / seconds if seconds else None,
    }
    curves = {"train_loss": sorted((s, r["loss"]) for s, r in train.items() if "loss" in r),
              "dev_loss": sorted((s, r["loss"]) for s, r in valid.items() if "loss" in r),
              "dev_bleu": sorted((s, r["bleu"]) for s, r in dev_bleu.items() if "bleu" in r)}
    return row, curves


def collect(sweep_dir: str) -> tuple[list[str], list[dict[str, Any]], dict[str, dict]]:
    """(axes, one row per run, curves per run) from sweep.json and each run's workdir."""
    manifest = files.read_json(os.path.join(sweep_dir, MANIFEST), None, cache=True)
    if manifest is None:
        raise SweepError(f"{os.path.join(sweep_dir, MANIFEST)} not found: not a sweep directory")
    axes, rows, curves = manifest["axes"], [], {}
    for run in manifest["runs"]:
        workdir = os.path.join(sweep_dir, run["name"])
        target = {"num_train_steps": run["num_train_steps"], "max_train_minutes": run.get("max_train_minutes")}
        row, curves[run["name"]] = run_row(workdir, target)
        if run.get("invalid"):
            state, status = "invalid", {"error": run["invalid"]}
        else:
            state, status = run_state(workdir, target)
        wall = status.get("total_wall_seconds")
        if state == "running" and status.get("started"):
            wall = float(wall or 0.0) + time.time() - status["started"]
        rows.append({"name": run["name"], **{key: run["overrides"].get(key, "") for key in axes}, **row,
                     "wall_seconds": wall, "status": state, "exit_code": status.get("returncode"),
                     "error": status.get("error", "") if state in ("failed", "stopped", "invalid") else ""})
    return axes, rows, curves


def write_csv(path: str, axes: list[str], rows: list[dict]) -> None:
    columns = ["name", *axes, "status", "exit_code", "error", "dev_bleu", "best_dev_bleu", "test_bleu", "scored",
               "train_loss", "dev_loss", "dev_perplexity", "step", "num_train_steps", "tokens_per_second", "wall_seconds"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(buffer.getvalue())


def _number(value, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown_table(axes: list[str], rows: list[dict]) -> str:
    """The results as a Markdown table: one row per run, axes by their leaf names."""
    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    labels = [key.rsplit(".", 1)[-1] for key in axes]
    header = ["run", *labels, "dev BLEU", "best dev BLEU", "test BLEU", "train loss", "dev loss", "steps",
              "tokens/s", "wall", "status"]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "---|" * (1 + len(labels)) + "---:|" * (len(header) - 2 - len(labels)) + "---|"]
    for row in rows:
        steps = "" if row["step"] is None else (
            str(row["step"]) if row["step"] == row["num_train_steps"] else
            f"{row['step']} (timed)" if row["status"] == "done" else f"{row['step']}/{row['num_train_steps']}")
        status = row["status"]
        if status == "failed":
            status = f"failed (exit {row['exit_code']}): {row['error']}"
        elif status in ("invalid", "stopped") and row["error"]:
            status = f"{status}: {row['error']}"
        values = [row["name"], *(name_value(row[key]) for key in axes), _number(row["dev_bleu"], 2),
                  _number(row["best_dev_bleu"], 2), _number(row["test_bleu"], 2), _number(row["train_loss"], 3),
                  _number(row["dev_loss"], 3), steps, _number(row["tokens_per_second"], 0),
                  format_seconds(row["wall_seconds"]), status]
        lines.append("| " + " | ".join(cell(v) for v in values) + " |")
    return "\n".join(lines) + "\n"


def plot(path: str, axes: list[str], rows: list[dict], curves: dict[str, dict], title: str = "sweep") -> None:
    """results.png: dev BLEU (top) and dev loss (bottom) against each swept axis (one dot per run, a line
    through the means), and against steps (one line per run). Needs matplotlib (the `plot` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, grid = plt.subplots(2, len(axes) + 1, figsize=(4.2 * (len(axes) + 1), 7.5), squeeze=False)
    for column, key in enumerate(axes):
        values = sorted({row[key] for row in rows if row[key] != ""}, key=lambda v: (str(type(v)), v))
        for line, (metric, label) in enumerate((("dev_bleu", "dev BLEU"), ("dev_loss", "dev loss"))):
            ax = grid[line][column]
            points = [(values.index(row[key]), row[metric]) for row in rows
                      if row["status"] == "done" and row[key] in values and row[metric] is not None]
            if points:
                ax.scatter(*builtins.zip(*points), alpha=0.6)
                means = [(x, sum(y for px, y in points if px == x) / sum(1 for px, _ in points if px == x))
                         for x in sorted({px for px, _ in points})]
                ax.plot(*builtins.zip(*means), color="black", linewidth=1)
            ax.set_xticks(range(len(values)), [name_value(v) for v in values])
            ax.set_xlabel(key)
            ax.set_ylabel(label)
    for line, (metric, label) in enumerate((("dev_bleu", "dev BLEU"), ("train_loss", "train loss (dots: dev)"))):
        ax = grid[line][-1]
        for index, (name, run_curves) in enumerate(curves.items()):
            color = f"C{index % 10}"
            if run_curves[metric]:
                ax.plot(*builtins.zip(*run_curves[metric]), color=color, label=name,
                        marker="o" if metric == "dev_bleu" else None)
            if metric == "train_loss" and run_curves["dev_loss"]:
                ax.scatter(*builtins.zip(*run_curves["dev_loss"]), color=color, s=12)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
    if len(curves) <= 12:
        grid[0][-1].legend(fontsize=6)
    done = sum(row["status"] == "done" for row in rows)
    figure.suptitle(f"{title}: {done} of {len(rows)} runs done (against axes: done runs only)")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def write_results(sweep_dir: str, echo: Callable[[str], None] = print) -> str:
    """results.csv, results.md and (with matplotlib) results.png in sweep_dir; returns the Markdown table."""
    axes, rows, curves = collect(sweep_dir)
    write_csv(os.path.join(sweep_dir, "results.csv"), axes, rows)
    table = markdown_table(axes, rows)
    with open(os.path.join(sweep_dir, "results.md"), "w", encoding="utf-8") as handle:
        handle.write(table)
    written = "results.csv, results.md"
    try:
        plot(os.path.join(sweep_dir, "results.png"), axes, rows, curves,
             title=os.path.basename(os.path.normpath(sweep_dir)))
        written += ", results.png"
    except ImportError:
        echo("results.png skipped: matplotlib is not installed (pip install -e '.[plot]')")
    counts = {state: sum(row["status"] == state for row in rows) for state in dict.fromkeys(r["status"] for r in rows)}
    echo(f"{sweep_dir}: " + ", ".join(f"{n} {state}" for state, n in counts.items()) + f"; wrote {written}")
    return table
