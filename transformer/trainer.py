"""The training run behind train.py: everything validated and built before any write that could replace a file
(`Run`), the train and eval steps compiled once on the real shapes, then the loop (`Loop`): the next batch, the
step, and the periodic actions due (transformer/loop.py); at its end the last save, the valid loss and the final
(averaged) parameters scored, in scores.json."""

from __future__ import annotations

import dataclasses
import os
import time
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from transformer import config_files, console, data, files, loop, metrics, mixture, sharding, throughput
from transformer import workdir as workdirs
from transformer.checkpoint import RunCheckpoints, abstract_like
from transformer.console import log
from transformer.evaluation import Evaluator, RunEvaluation, router_line
from transformer.plan import count_params, create_train_state, make_plan, make_steps, plan_batch, recorded_batch, \
    rows_multiple
from transformer.restore import load_workdir_config, warm_start, warm_start_config
from transformer.settings import Settings, check_resume_config, flatten, saved_config
from transformer.steps import TrainState
from transformer.token_cache import TokenCache
from transformer.tokenizer import Tokenizer
from transformer.workdir import CHECKPOINTS_DIR, CONFIG_FILE, RUN_FILE


@dataclasses.dataclass
class Corpus:
    tokenizer: Tokenizer
    pairs: dict[str, list[tuple[str, str]]]  # split -> raw (source, target) sentences, read on first use
    valid: TokenCache  # the dev set, tokenized, for the eval loss
    valid_kept: np.ndarray  # indices into valid of the pairs within max_length
    train_cache: TokenCache  # the tokenized train split
    train_kept: np.ndarray  # indices into train_cache of the pairs within max_length
    train_source: Any = None  # the train split's fingerprint (what its token cache was built from)
    mixture: list[mixture.Source] = dataclasses.field(default_factory=list)  # data.mixture's sources, main among them


def load_corpus(settings: Settings, workdir: str, splits: list[str]) -> Corpus:
    """Read the evaluation splits and fingerprint the train split (input errors surface here, before
    training), then the tokenizer and the train split's token cache. The train split itself is read (once,
    streamed) only when its vocabulary or its cache must be built: a restart does not read it."""
    pairs = data.SplitPairs(settings.data)  # the train split's text is read only if decoded (bleu_splits)
    # A mixture's missing source fails here, before any corpus is read.
    found = mixture.fingerprints(settings.data) if settings.data.mixture else []
    for split in splits:
        if split != "train" and not pairs[split]:
            raise data.DataError(f"the {split} split has no sentence pairs")
    with data.split_source(settings.data, "train") as train:  # removes the train split's spill, if one was made
        if jax.process_count() > 1 and not settings.data.vocab_path:
            # One process trains the vocabulary into the (shared) workdir; the others read it afterwards.
            from jax.experimental import multihost_utils
            if jax.process_index() == 0:
                data.load_or_train_tokenizer(settings.data, train, workdir)
            multihost_utils.sync_global_devices("vocabulary written")
        tokenizer = data.load_or_train_tokenizer(settings.data, train, workdir)
        recorded = workdirs.read_run_file(workdir)
        workdirs.check_vocabulary(recorded.get("vocabulary"), tokenizer.path)  # before any token is cached with it
        source = data.as_split_source(train, "train").fingerprint
        if recorded.get("train_data") not in (None, source):
            # A warning, not a refusal: text files are known by path, size and mtime, which a copy or a touch changes.
            log.warning("the train split's fingerprint %s differs from the one this run started with, %s (in %s): "
                        "its token cache is built again, and the batches from here on may differ", source,
                        recorded["train_data"], os.path.join(workdir, RUN_FILE))
        cache = data.load_or_build_token_cache(train, tokenizer, workdir, "train", num_workers=settings.data.num_workers,
                                               local_root=settings.data.local_cache_dir)
    cleaned = mixture.clean(cache, settings.data, tokenizer)
    log.info(cleaned.line("main"))
    if not len(cleaned.kept):
        raise data.DataError(f"no train pair is left after data.max_length={settings.data.max_length} and the "
                             "data.filter_* settings")
    main = mixture.Source("main", 1.0, cache, cleaned.kept)
    sources = mixture.load_sources(settings.data, tokenizer, workdir, main, found) if found else []
    valid = TokenCache.tokenize(tokenizer, pairs["valid"])
    valid_filter = data.LengthFilter.of(valid, settings.data.max_length)
    decoded = "" if settings.model.get("family") == "encoder_only" else " (BLEU decodes them all)"
    log.info("valid loss: %d pairs, %d longer than %d tokens left out%s", len(valid_filter.kept),
             valid_filter.too_long, settings.data.max_length, decoded)
    if not len(valid_filter.kept):
        raise data.DataError(f"every valid pair is longer than data.max_length={settings.data.max_length} tokens")
    return Corpus(tokenizer, pairs, valid, valid_filter.kept, cache, cleaned.kept, source, sources)


def batches_with_states(iterator, shares: mixture.Shares | None = None) -> Iterator[tuple[dict, bytes]]:
    """(batch, the iterator's state right after it): the state a checkpoint of that batch's step saves. A
    mixture's batches leave their source counts in `shares` (on the host: no sync)."""
    while True:
        batch = next(iterator)
        yield shares.take(batch) if shares else batch, data.iterator_state_json(iterator)


def prefetch_to_device(batches: Iterator[tuple[dict, Any]], batch_sharding, size: int = 2
                       ) -> Iterator[tuple[dict, Any]]:
    """Keep `size` batches in flight to the devices while the current step runs; passes each one's state on. The one
    place training batches meet the devices: this process's rows -> global arrays split over the batch axes."""
    queue: deque = deque()
    for batch, state in batches:
        queue.append((sharding.place_local_batch(batch, batch_sharding), state))
        if len(queue) >= size:
            yield queue.popleft()
    yield from queue


def previous_train_totals(workdir: str, start_step: int) -> tuple[float, int, float]:
    """The training seconds a stopped run had spent up to start_step (its last train record in metrics.jsonl), the
    non-finite updates it had skipped and its last pace in steps per second, so that train.max_train_minutes, the
    time-to-BLEU curve and train.max_skipped_updates count the whole run."""
    seconds, skipped, pace = 0.0, 0, 0.0
    for record in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if start_step else []:
        if record.get("split") == "train" and record.get("step", 0) <= start_step:
            seconds = record.get("train_seconds", seconds)
            pace = record.get("steps_per_second", pace)
            skipped += int(record.get("skipped_updates", 0))
    return seconds, skipped, pace


def committed_steps(workdir: str) -> list[int]:
    """The steps of the workdir's committed checkpoints, oldest first: Orbax renames a checkpoint to its step whole."""
    return sorted(int(name) for name in files.list_dir(os.path.join(workdir, CHECKPOINTS_DIR)) if name.isdigit())


class Run:
    """One training run in one workdir: everything is validated and built in __init__, before any write
    that could replace an existing file; `train()` then compiles and runs the loop."""

    def __init__(self, config: Mapping[str, Any], workdir: str):
        self.is_writer = jax.process_index() == 0
        if not self.is_writer:  # one console: process 0's, from the first line on
            console.only_warnings()
        self.config, self.workdir = warm_start_config(config_files.plain(config)), workdir
        self.settings = Settings.from_config(self.config)
        files.check_storage(workdir, "--workdir")
        if files.exists(workdir) and not files.is_dir(workdir):
            raise NotADirectoryError(f"--workdir={workdir} exists and is not a directory")
        files.check_writable(workdir, "--workdir", "a training run keeps its lock, checkpoints and logs there (eval.py "
                             "and translate read a workdir they may not write)")
        self.checkpoints: RunCheckpoints | None = None
        self.lock = None
        # SIGTERM and SIGINT from here to close(): in the loop a step's checkpoint, elsewhere a stop (loop.Preemption).
        self.signals = loop.Preemption()
        if not self.signals.service:  # under JAX's service only the loop handles them
            self.signals.install()
        try:
            self.signals.enter("start-up")
            self.lock = workdirs.acquire_workdir(workdir)  # before anything reads or writes the workdir
            self._start(self.config, workdir)
        except BaseException as error:
            self.close()  # a refused start leaves the workdir as it found it, and free
            self.say_stopped(error)
            raise

    def _start(self, config: dict[str, Any], workdir: str) -> None:
        settings, train = self.settings, self.settings.train
        splits = ["train", "valid"] + [s for s in settings.decode.splits if s != "valid"]
        resuming = bool(committed_steps(workdir))
        if resuming:
            for change in check_resume_config(load_workdir_config(workdir), config):
                log.info("resuming with a changed setting: %s", change)
        # The mesh and the batch are settled before any data work, so a batch that cannot split fails at once.
        self.mesh = sharding.make_mesh(settings.mesh)
        self.batch, note = plan_batch(settings.data, rows_multiple(settings, self.mesh.shape),
                                      recorded_batch(workdir) if resuming else None)
        if note:
            log.warning("%s", note)
        files.make_dirs(workdir)
        if train.debug_nans:
            jax.config.update("jax_debug_nans", True)
        workdirs.use_compilation_cache(train.compilation_cache_dir, workdir)
        self.corpus = load_corpus(settings, workdir, splits)
        self.shares = mixture.Shares([source.label for source in self.corpus.mixture]) if self.corpus.mixture else None
        tokenizer = self.corpus.tokenizer
        self.plan = make_plan(settings, tokenizer.vocab_size, self.mesh, self.batch)
        self.checkpoints = RunCheckpoints(workdir, every=train.checkpoint_every_steps, keep=train.keep_checkpoints,
                                          use_async=train.async_checkpointing,
                                          average_last=settings.decode.average_last,
                                          before_save=lambda: workdirs.check_workdir_lock(self.lock))
        self.state, self.data_state, init_from = self._restore_or_init()  # the data iterator's state, restored
        if train.keep_best_checkpoint:
            self.checkpoints.open_best()
        self.evaluator = Evaluator(settings, self.plan.model_config, self.plan.graphdef, tokenizer,
                                   self.plan.batch_sharding, self.batch.rows, self.corpus.pairs)
        self.evaluator.splits["valid"] = (self.corpus.valid, self.corpus.valid_kept)
        if self.is_writer:
            files.write_text(os.path.join(workdir, CONFIG_FILE), saved_config(config, tokenizer))
            workdirs.record_start(workdir, self.batch, self.mesh, train.num_microbatches,
                                  workdirs.vocabulary_record(tokenizer.path, tokenizer.vocab_size),
                                  self.corpus.train_source, init_from)

    def close(self) -> None:
        """Commit every pending save, close the checkpoint managers, free the workdir and put the signal handlers
        back (idempotent)."""
        try:
            if self.checkpoints is not None:
                self.checkpoints.close()
        finally:
            if self.lock is not None:
                workdirs.release_workdir(self.workdir, self.lock)
                self.lock = None
            self.signals.uninstall()

    def say_stopped(self, error: BaseException) -> None:
        """After a stop signal outside the loop (loop.Stopped), once closed: one line, what is kept and what next."""
        if not isinstance(error, loop.Stopped):
            return
        directory, steps = os.path.join(self.workdir, CHECKPOINTS_DIR), committed_steps(self.workdir)
        kept = f"the checkpoint of step {steps[-1]} is committed in {directory}" if steps else "no checkpoint is saved"
        then = ("evaluate it and finish" if error.phase == "the final evaluation" else
                "resume from it" if steps else "start again")
        log.warning("%s during %s: stopped; %s; run the same command to %s (exit status %d)", error.signal_name,
                    error.phase, kept, then, loop.EXIT_PREEMPTED)

    def _restore_or_init(self) -> tuple[TrainState, bytes | None, dict[str, Any] | None]:
        """(The state, the data iterator's state, what run.json records of a warm start): this run's newest
        checkpoint, else a new state, its parameters those train.init_from names if set."""
        plan, states, seed = self.plan, self.checkpoints.states, self.settings.seed
        spec = self.settings.train.init_from
        if states.latest_step() is None:
            state, record = create_train_state(plan.model_config, plan.optimizer, seed, plan.state_shardings), None
            if spec:
                params, record = warm_start(spec, plan.abstract_state(seed).params)
                state = state.replace(params=params)  # Adam's moments start at zero whatever the parameters
                log.info("initialised from %s (%s): a fresh optimizer, schedule and data position", record["workdir"],
                         record["params"])
            return state, None, record
        # Restored straight into this run's shardings, whatever mesh wrote the checkpoint: the newest readable one
        # (unreadable newer ones are named and moved aside); raises, touching nothing, on a shape mismatch.
        step, state, data_state = states.restore_latest(plan.abstract_state(seed))
        log.info("resumed from %s at step %d", states.directory, step)
        return state, data_state, None

    def compile(self) -> tuple[Any, Any, float]:
        """The jitted train and eval steps, compiled once on the real shapes; returns the compile seconds."""
        plan = self.plan
        batch = plan.abstract_batch()
        train, evaluate = make_steps(plan.graphdef, plan.optimizer, plan.schedule, self.settings.train,
                                     plan.state_shardings, plan.batch_sharding)
        start = time.perf_counter()
        train = train.lower(abstract_like(self.state), batch).compile()
        evaluate = evaluate.lower(abstract_like(self.state.params), batch).compile()
        return train, evaluate, time.perf_counter() - start

    def compile_and_log(self) -> tuple[Any, float]:
        """The compiled train step and the compile seconds; the eval step goes to the evaluator."""
        log.info("model: %s parameters; vocab %d; %d rows x %d tokens per batch", f"{count_params(self.state.params):,}",
                 self.plan.model_config.vocab_size, self.batch.rows, self.batch.row_length)
        log.info("mesh %s over %d devices (%s) in %d processes", dict(self.mesh.shape), jax.device_count(),
                 jax.devices()[0].device_kind, jax.process_count())
        train, self.evaluator.evaluate, compile_seconds = self.compile()
        log.info("compiled train and eval steps in %.1fs", compile_seconds)
        return train, compile_seconds

    def train(self) -> dict[str, Any]:
        """Compile, then the loop from the state's step; then the end's save, evaluation and scores. After a stop
        signal it returns {"preempted": step} instead, with that step's checkpoint committed."""
        part = None
        try:
            self.signals.enter("compiling")
            train, compile_seconds = self.compile_and_log()
            self.signals.enter("start-up")
            start_step = int(self.state.step)
            iterator = self.train_iterator()
            part = Loop(self, train, start_step)
            try:
                stop = part.run_steps(prefetch_to_device(batches_with_states(iterator, self.shares),
                                                         self.plan.batch_sharding))
            finally:
                part.profile.stop()
                if hasattr(iterator, "close"):
                    iterator.close()  # stops grain's worker processes, on an error or a signal too
            if stop and stop.startswith("preempted"):
                return part.finish_preempted()
            return part.finish(compile_seconds, stop)
        except BaseException as error:
            if part is not None:
                part.progress.close()
                part.writer.close()
            self.close()  # the saves already begun are committed; the workdir is free for the next start
            self.say_stopped(error)
            raise

    def train_iterator(self):
        """The grain iterator of this process's training batches, positioned after the restored step's batch."""
        settings = self.settings.data
        common = dict(seed=self.settings.seed, max_length=settings.max_length, rows_per_batch=self.batch.rows,
                      shard=data.Shard.of_process(), num_workers=settings.num_workers, pack=settings.pack)
        iterator = iter(mixture.train_dataset(self.corpus.mixture, **common) if self.corpus.mixture else
                        data.train_dataset(self.corpus.train_cache, self.corpus.train_kept, **common))
        if self.data_state is not None:  # none in a checkpoint saved before any batch was drawn (0 steps)
            data.restore_iterator(iterator, self.data_state)
        return iterator


def log_notes(summary: dict[str, float]) -> str:
    """The end of a training log line, where they apply: the updates skipped, a mixture of experts' router stats,
    a risk objective's expected risk and mean sampled BLEU per sentence."""
    skipped = f", {summary['skipped_updates']} non-finite updates skipped" if summary["skipped_updates"] else ""
    risk = f", risk {summary['risk']:.4f} sampled BLEU {summary['reward']:.4f}" if "risk" in summary else ""
    shares = " ".join(f"{key[6:]} {value:.0%}" for key, value in summary.items() if key.startswith("share_"))
    return skipped + router_line(summary) + risk + (f", target tokens from {shares}" if shares else "")


class Loop:
    """One part of a run's training, the steps after `start_step`: the next batch, the step, then the periodic
    actions (transformer/loop.py), in the order their hooks run, over what this object offers them: the state,
    the clock, the budget, saves, the run's evaluations and the final scores."""

    def __init__(self, run: Run, train_step, start_step: int):
        config, workdir = run.settings.train, run.workdir
        self.run, self.train_step, self.start_step, self.data_state = run, train_step, start_step, run.data_state
        self.writer = metrics.MetricWriter(workdir, enabled=run.is_writer, resume_step=start_step,
                                           local_root=run.settings.data.local_cache_dir,
                                           wandb_project=config.wandb_project, hparams=flatten(run.config))
        self.progress = metrics.Progress(config.num_train_steps, start_step)
        self.evaluation = RunEvaluation(run.evaluator, workdir, self.writer, self.progress, lambda step, bleu:
                                        run.checkpoints.save_best(step, run.state.params, bleu))
        self.peak_flops = throughput.device_peak_flops(dtype=run.plan.model_config.dtype)
        seconds_before, skipped_before, pace_before = previous_train_totals(workdir, start_step)
        self.window = loop.MetricsWindow(start_step + 1, config.nonfinite, config.max_skipped_updates, skipped_before)
        self.budget = loop.TimeBudget(config.max_train_minutes, config.log_every_steps)
        if start_step and pace_before:  # a resumed run's budget: what is left of it at the last part's pace
            self.budget.update(start_step, 1, seconds_before - 1 / pace_before, seconds_before)
        self.marks = loop.ReportMarks(config.report_marks, workdirs.read_reports(workdir) if start_step else {})
        self.cooldown = loop.Cooldown(run.settings.optimizer.cooldown_fraction, config.num_train_steps,
                                      run.state.opt_state, self.progress)
        self.preemption = run.signals
        self.profile = loop.Profile(config.profile_range, os.path.join(workdir, "profile"), start_step)
        # Their order is the order of their hooks: the stop reasons of a preemption, the budget and a cooldown done,
        # in that order; a timed save before the cooldown begun by time changes the state; the dev loss before BLEU.
        self.actions: list[loop.Action] = [
            self.preemption, self.budget, loop.TimedCheckpoint(config.checkpoint_every_minutes), self.cooldown,
            self.marks, loop.Every(config.eval_every_steps, lambda part, step: part.report_loss(step)),
            loop.Every(config.bleu_every_steps, lambda part, step: part.report_dev_bleu(step), syncs=True),
            loop.Every(config.log_every_steps, syncs=True), loop.Checkpoint(config.checkpoint_every_steps),
            self.profile]
        timed = self.budget.limited or bool(self.marks.marks) or config.checkpoint_every_minutes > 0
        # The trainer's own clock reading (time.perf_counter looked up at each call), which the tests replace.
        self.clock = loop.Clock(seconds_before, timed, now=lambda: time.perf_counter())
        self.saved_at = self.clock.seconds  # the training seconds at the last save (checkpoint_every_minutes)
        self.part_start = (start_step, self.clock.seconds)  # this part's pace projects a timed decay's end
        self.last_step = start_step  # the last fetched step
        self.final_step = self.cooldown.final_step()
        # Why a run that had already ended by time (budget spent, timed decay done) trains no further when started
        # again: the same command re-evaluates it, as it does a run at num_train_steps.
        self.ended_before = None
        if self.budget.limited and self.budget.spent():
            self.ended_before = f"the time budget of train.max_train_minutes={config.max_train_minutes:g} was spent"
        elif self.final_step < config.num_train_steps and self.final_step <= start_step:
            self.ended_before = f"the cooldown (optimizer.cooldown_fraction={self.cooldown.fraction:g}) was done"
        if self.ended_before:
            self.final_step = start_step
            log.info("%s before this start, at step %d: evaluating it again, training no further", self.ended_before,
                     start_step)

    @property
    def state(self) -> TrainState:
        return self.run.state

    @state.setter
    def state(self, state: TrainState) -> None:
        self.run.state = state

    def run_steps(self, batches) -> str | None:
        """Every step after start_step up to the final one; returns why the run stopped before, or None."""
        stop = None
        with self.preemption.during("training", then="saving"):
            for step in range(self.start_step + 1, self.final_step + 1):
                stop = self.step(step, batches)
                if stop:
                    break
        if stop is None and self.preemption.received and not self.preemption.service:
            # A signal during the last step's fetch or save, after its check: still a stop, not the final evaluation.
            self.save(int(self.state.step), force=True)
            stop = f"preempted by {self.preemption.received}"
        return stop

    def step(self, step: int, batches) -> str | None:
        """The next batch, the step, and the actions due; returns a reason to stop after it, or None."""
        waited = time.perf_counter()
        batch, self.data_state = next(batches)
        self.window.input_seconds += time.perf_counter() - waited
        for action in self.actions:
            action.before_step(self, step)
        self.state, step_metrics = self.train_step(self.state, batch)
        self.window.add(step_metrics)
        for action in self.actions:
            action.after_step(self, step)
        syncs = [action.syncs(self, step) for action in self.actions]  # each is asked: a preemption's is collective
        if any(syncs) or step == self.final_step:
            self.log_window(step)  # the fetch: raises on a non-finite step, before any save
            stop = next((reason for action in self.actions if (reason := action.stop_reason(self, step))), None)
            if stop:
                self.save(step, force=True)
                return stop
            for action in self.actions:
                action.at_sync(self, step)
        if step != self.final_step:  # the final step is evaluated by the end of the run
            with self.clock.paused():  # evaluation does not count as training time
                for action in self.actions:
                    action.off_the_clock(self, step)
        for action in self.actions:
            action.end_of_step(self, step)
        return None

    def log_window(self, step: int) -> dict[str, float]:
        """Fetch the window's metrics, advance the clock and the budget's projection, write the log line."""
        summary = self.window.fetch(last_checkpoint=self.run.checkpoints.last_checkpoint())
        before, seconds = self.clock.seconds, self.clock.tick()
        steps, self.last_step = step - self.last_step, step
        self.budget.update(step, steps, before, self.clock.seconds)
        summary["train_seconds"] = self.clock.seconds  # training only: no compilation or evaluation
        summary.update(self.run.shares.summary() if self.run.shares else {})
        # The share of the window spent getting the next batch: near 1, the run is input-bound.
        summary["input_wait_fraction"], self.window.input_seconds = self.window.input_seconds / max(seconds, 1e-9), 0.0
        summary.update(throughput.window_metrics(summary, self.run.plan.model_config, seconds, steps, self.peak_flops))
        eta = min((self.run.settings.train.num_train_steps - step) / summary["steps_per_second"],
                  self.budget.left(self.clock.seconds))
        self.writer.write(step, summary, "train")
        self.progress.update(steps, summary)
        self.progress.write(f"step {step}: loss {summary['loss']:.4f} acc {summary['accuracy']:.3f} "
                            f"lr {summary['learning_rate']:.2e} grad_norm {summary['grad_norm']:.3f} "
                            f"{summary['tokens_per_second']:.0f} target tokens/s "
                            f"({summary['all_tokens_per_second']:.0f} with source), "
                            f"MFU {summary.get('mfu', float('nan')):.3f}, ETA {eta:.0f}s{log_notes(summary)}")
        return summary

    def save(self, step: int, force: bool = False) -> None:
        """The step's checkpoint where one is due (or `force`), with the data iterator's state after its batch."""
        if self.run.checkpoints.save(step, self.state, self.data_state, force):
            self.saved_at = self.clock.seconds

    def pace(self, step: int) -> float:
        """This part's steps per training second."""
        return (step - self.part_start[0]) / max(self.clock.seconds - self.part_start[1], 1e-9)

    def report_loss(self, step: int | None = None) -> dict[str, float]:
        return self.evaluation.loss(self.state.params, int(self.state.step))

    def report_dev_bleu(self, step: int) -> None:
        self.evaluation.bleu(self.state.params, int(self.state.step), ["valid"], self.clock.seconds)

    def score_final(self) -> dict[str, Any]:
        """The end's scores, also at each train.report_minutes mark: the mean of the last checkpoints (or the final
        parameters), decoded and scored on decode.bleu_splits."""
        params, averaged = self.run.checkpoints.final_params(self.state.params, self.run.plan.state_shardings.params)
        return self.evaluation.final(params, averaged, int(self.state.step), self.clock.seconds)

    def write_reports(self, reports: dict[str, Any]) -> None:
        workdirs.write_reports(self.run.workdir, reports)

    def finish(self, compile_seconds: float, stop: str | None = None) -> dict[str, Any]:
        """The end of the run: the last save, the valid loss, the final (averaged) parameters scored, scores.json.
        `stop` is why the loop ended before num_train_steps (the budget, a timed cooldown), if it did."""
        self.progress.close()
        step = int(self.state.step)
        train = self.run.settings.train
        # What ended the run, with the settings that decided it: a sweep counts a run ended by its time budget as
        # done only while these are still the point's.
        end = {"reason": stop or self.ended_before or "train.num_train_steps", "num_train_steps":
               train.num_train_steps, "max_train_minutes": train.max_train_minutes}
        result = {"step": step, "end": end, "compile_seconds": compile_seconds, "train_seconds": self.clock.seconds}
        if self.window.skipped:  # the whole run's total, also in scores.json: the window lines are easy to miss
            result["skipped_updates"] = self.window.skipped
            log.warning("train.nonfinite=skip: %d of %d updates were skipped as non-finite in this run (limit "
                        "train.max_skipped_updates=%d)", self.window.skipped, step,
                        self.run.settings.train.max_skipped_updates)
        self.run.signals.enter("saving")  # a signal here waits for the save, then stops the evaluation
        if step != self.run.checkpoints.states.last_saved:  # the same answer on every process
            self.save(step, force=True)
        self.run.signals.enter("the final evaluation")  # a signal stops it; the same command evaluates again
        result["valid"] = self.report_loss()
        final = self.score_final()
        self.run.signals.enter("finishing")  # past this, the run ends as if no signal came
        if final["averaged_steps"]:
            result["averaged_steps"] = final["averaged_steps"]
        scored = "masked" if "masked" in final else "bleu"
        result[scored] = final[scored]
        self.marks.record(self.clock.seconds, final)  # marks passed in the same fetch as the budget: the end's scores
        if self.marks.reports:
            result["reports"] = self.marks.reports
            self.write_reports(self.marks.reports)
        self.run.checkpoints.close()
        if scored == "bleu":
            self.writer.write_final({f"{split}_bleu": score["bleu"] for split, score in result["bleu"].items()})
        else:
            self.writer.write_final({f"{split}_masked_{key}": score[key] for split, score in result["masked"].items()
                                     for key in ("accuracy", "perplexity")})
        self.writer.close()
        if self.run.is_writer:
            files.write_json(os.path.join(self.run.workdir, "scores.json"), result)
        self.run.close()
        return result

    def finish_preempted(self) -> dict[str, Any]:
        """After a stop signal: the step's checkpoint committed, the logs closed, one line naming the step."""
        self.progress.close()
        self.writer.close()
        self.run.close()  # waits until every save is committed, then frees the workdir
        step, received = int(self.state.step), self.preemption.received
        log.warning("%s: stopped at step %d with its checkpoint committed in %s; run the same command to resume "
                    "(exit status %d)", received, step, self.run.checkpoints.states.directory, loop.EXIT_PREEMPTED)
        return {"preempted": step, "signal": received}
