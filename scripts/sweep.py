"""Run, emit or collect a hyperparameter sweep defined beside a config (`get_sweep()` in configs/X.py).

    python scripts/sweep.py --config=configs/default.py --sweep_dir=runs/sweep --parallel=2
    python scripts/sweep.py --config=configs/base.py --sweep_dir=runs/grid --skip_invalid --emit=slurm
    python scripts/sweep.py --collect runs/sweep

Every point is validated before anything launches; each runs `train.py` in its own workdir SWEEP_DIR/<name>.
Re-running the same command skips finished runs and resumes unfinished ones from their checkpoints.
Exit status: 0 all runs done, 1 a run failed, 2 the sweep was refused before launching, 130 interrupted.
See docs/sweeps.md.
"""

import functools
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from transformer import console, sweep, sweep_results, sweep_runner  # noqa: E402

flags.DEFINE_string("config", os.path.join(ROOT, "configs", "default.py"),
                    "Config file, path.py or path.py:argument as for train.py; its get_sweep() is the sweep.")
flags.DEFINE_string("sweep", None, "Take the points from file.py (its get_sweep()) or file.py:function instead.")
flags.DEFINE_string("sweep_dir", None, "Directory of the sweep: sweep.json, results.*, one workdir per run.")
flags.DEFINE_integer("parallel", 1, "Runs at a time, as local processes splitting the GPUs or CPU cores. With "
                     "--emit=slurm: at most this many array tasks at once (%N).", lower_bound=1)
flags.DEFINE_enum("emit", None, ["slurm"], "Write launch scripts (slurm: one per run and a job array) and run nothing.")
flags.DEFINE_bool("skip_invalid", False, "Skip points the config refuses (e.g. num_heads not dividing emb_dim) "
                  "instead of refusing the whole sweep.")
flags.DEFINE_string("collect", None, "Collect this sweep directory into results.csv/.md/.png; run nothing.")
flags.DEFINE_multi_string("only", None, "Run only the point(s) with this name (what each SLURM script does).")
flags.DEFINE_bool("dry_run", False, "Validate and print every point with its train.py command; run nothing.")
flags.DEFINE_multi_string("slurm_option", [], "With --emit=slurm: an #SBATCH option, e.g. --slurm_option=--gres=gpu:1 "
                          "--slurm_option=--time=24:00:00 (repeatable).")
flags.DEFINE_multi_string("slurm_setup", [], "With --emit=slurm: a shell line run before training, e.g. "
                          "'source venv/bin/activate' (repeatable).")
FLAGS = flags.FLAGS
echo = functools.partial(print, flush=True)


def absolute(spec: str | None) -> str | None:
    """path[:argument] with an absolute path, so that commands and SLURM scripts work from anywhere."""
    if spec is None:
        return None
    path, argument = sweep_runner.split_spec(spec)
    return os.path.abspath(path) + (f":{argument}" if argument is not None else "")


def select(points: list[sweep_runner.Point], names: list[str] | None) -> list[sweep_runner.Point]:
    if not names:
        return points
    known = {p.name: p for p in points}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise sweep.SweepError(f"--only names no point of this sweep: {unknown}; points: {sorted(known)}")
    return [known[name] for name in names]


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    console.route_libraries()  # as train.py: one console, on stderr; the results table on stdout
    try:
        if FLAGS.collect:
            echo(sweep_results.write_results(FLAGS.collect, echo=echo), end="")
            return 0
        if not FLAGS.sweep_dir:
            raise app.UsageError("--sweep_dir is required (or --collect DIR)")
        return run(absolute(FLAGS.config), absolute(FLAGS.sweep), os.path.abspath(FLAGS.sweep_dir))
    except sweep.SweepError as error:
        echo(f"sweep: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: run_points has stopped the children and recorded them
        echo("sweep: interrupted; the same command resumes the stopped runs from their checkpoints", file=sys.stderr)
        # 75 when every stopped run committed its checkpoint: the emitted SLURM scripts requeue on it.
        return sweep_runner.EXIT_PREEMPTED if getattr(stop, "resumable", False) else 130


def run(config_spec: str, sweep_spec: str | None, sweep_dir: str) -> int:
    points = sweep_runner.make_points(config_spec, sweep_runner.load_sweep(config_spec, sweep_spec))
    valid = select(sweep_runner.refuse_invalid(points, FLAGS.skip_invalid), FLAGS.only)
    for point in points:
        if point.problem:
            echo(f"skipping invalid point {point.name}: {point.problem}")
    if FLAGS.dry_run:
        for point in valid:
            command = sweep_runner.train_command(config_spec, os.path.join(sweep_dir, point.name), point.overrides)
            echo(f"{point.name}\n  {shlex.join(command)}")
        echo(f"{len(valid)} runs valid; nothing was run (--dry_run)")
        return 0
    sweep_runner.write_manifest(sweep_dir, config_spec, sweep_spec, points)
    if FLAGS.emit == "slurm":
        scripts = sweep_runner.emit_slurm(valid, sweep_dir, config_spec, sweep_spec, FLAGS.skip_invalid,
                                   FLAGS.slurm_option, FLAGS.slurm_setup, max_running=FLAGS.parallel)
        slurm_dir = os.path.dirname(scripts[0])
        echo(f"wrote {len(scripts)} SLURM scripts in {slurm_dir}; nothing was run. Submit them all with\n"
             f"  sbatch {os.path.join(slurm_dir, 'array.sbatch')}\nor one with sbatch {scripts[0]}; then\n"
             f"  python {os.path.relpath(__file__)} --collect {sweep_dir}")
        return 0
    start = time.time()
    results = sweep_runner.run_points(valid, sweep_dir, config_spec, FLAGS.parallel, echo=echo)
    failed = sorted(name for name, code in results.items() if code and code != sweep_runner.EXIT_PREEMPTED)
    stopped = sorted(name for name, code in results.items() if code == sweep_runner.EXIT_PREEMPTED)
    echo(f"sweep: {len(results)} runs launched, {len(failed)} failed, {len(stopped)} stopped to resume, "
         f"{len(valid) - len(results)} already done, in {sweep_runner.format_seconds(time.time() - start)}")
    if not FLAGS.only:  # each SLURM task runs one point; --collect gathers them once they are through
        echo(sweep_results.write_results(sweep_dir, echo=echo), end="")
    return 1 if failed else sweep_runner.EXIT_PREEMPTED if stopped else 0


if __name__ == "__main__":
    app.run(main)
