import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from transformer import data, files, workdir
from transformer.errors import DataError
from transformer.tokenizer import train_tokenizer
from transformer.workdir import (VocabularyMismatchError, WorkdirInUseError, WorkdirLock,
                                 WorkdirLockLost)

# Another process: takes the lock (at time argv[4] if given, so that several race) and holds it until killed or
# until the file argv[3] appears; prints "held" or "refused <message>".
HOLDER = """
import os, sys, time
from transformer.workdir import WorkdirInUseError, WorkdirLock
directory, heartbeat_seconds, done_file, start_at = sys.argv[1:5]
time.sleep(max(float(start_at) - time.time(), 0))
try:
    lock = WorkdirLock(directory, heartbeat_seconds=float(heartbeat_seconds), stale_after_seconds=600).acquire()
except WorkdirInUseError as error:
    print("refused", error, flush=True)
    sys.exit(0)
print("held", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline and not (done_file and os.path.exists(done_file)):
    time.sleep(0.02)
lock.release()
"""


def start_holder(directory, heartbeat_seconds=60.0, done_file="", start_at=0.0):
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), str(heartbeat_seconds), str(done_file),
                             str(start_at)], stdout=subprocess.PIPE, text=True)


def write_foreign_lock(directory, *, host="another-host.example", age_seconds=0.0, **fields):
    """A lock as another job would have left it, written by hand."""
    heartbeat = workdir._now_text(time.time() - age_seconds)
    record = {"host": host, "pid": 4242, "started": heartbeat, "token": "f" * 32, "heartbeat": heartbeat, **fields}
    (directory / "lock.json").write_text(json.dumps(record))


def test_a_second_process_on_a_workdir_in_use_is_refused_naming_host_and_pid(tmp_path):
    done = tmp_path / "done"
    holder = start_holder(tmp_path / "work", done_file=done)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(WorkdirInUseError) as refused:
            WorkdirLock(str(tmp_path / "work")).acquire()
        message = str(refused.value)
        assert f"pid {holder.pid} on {socket.gethostname()}" in message and "last heartbeat" in message
        assert "use another --workdir" in message and str(tmp_path / "work" / "lock.json") in message
        assert json.loads((tmp_path / "work" / "lock.json").read_text())["pid"] == holder.pid  # left as it was
        started = time.monotonic()
        with pytest.raises(WorkdirInUseError, match=f"pid {holder.pid}"):
            WorkdirLock(str(tmp_path / "work")).acquire(wait_seconds=0.3)
        assert time.monotonic() - started >= 0.3
        threading.Timer(0.2, done.touch).start()  # the holder's run ends while we wait
        lock = WorkdirLock(str(tmp_path / "work")).acquire(wait_seconds=20)
        assert json.loads((tmp_path / "work" / "lock.json").read_text())["pid"] == os.getpid()
        lock.release()
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_killed_process_on_this_host_is_taken_over_at_once(tmp_path, warnings):
    holder = start_holder(tmp_path)
    assert holder.stdout.readline() == "held\n"
    holder.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 5
    while (workdir._proc_stat(holder.pid) or "Z")[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)  # killed but not yet reaped: a zombie, which is no holder
    with WorkdirLock(str(tmp_path)) as lock:
        assert json.loads((tmp_path / "lock.json").read_text())["token"] == lock.record["token"]
    holder.wait()
    assert f"stale workdir lock {tmp_path / 'lock.json'} of pid {holder.pid} on {socket.gethostname()}" in warnings.text
    assert f"pid {holder.pid} is no longer running on this host" in warnings.text
    assert not os.listdir(tmp_path)  # released: no lock, claim or temporary file left


def test_a_foreign_lock_is_stale_only_once_its_heartbeat_is_older_than_the_threshold(tmp_path, warnings):
    write_foreign_lock(tmp_path, age_seconds=120)
    with pytest.raises(WorkdirInUseError, match=r"held by pid 4242 on another-host.example \(started .*"
                                                r"last heartbeat 2 min ago\)"):
        WorkdirLock(str(tmp_path), heartbeat_seconds=10, stale_after_seconds=300).acquire()
    # A host of the same name but another boot (or container) cannot check that pid: the heartbeat decides.
    write_foreign_lock(tmp_path, host=socket.gethostname(), boot_id="another boot", pid=2**22 + 1)
    with pytest.raises(WorkdirInUseError, match="held by pid 4194305"):
        WorkdirLock(str(tmp_path), heartbeat_seconds=10, stale_after_seconds=300).acquire()
    write_foreign_lock(tmp_path, age_seconds=120)
    lock = WorkdirLock(str(tmp_path), heartbeat_seconds=10, stale_after_seconds=60).acquire()
    assert json.loads((tmp_path / "lock.json").read_text())["pid"] == os.getpid()
    assert "of pid 4242 on another-host.example" in warnings.text and "last heartbeat was 2 min ago" in warnings.text
    lock.release()


def test_an_unreadable_lock_is_judged_by_its_modification_time(tmp_path):
    (tmp_path / "lock.json").write_bytes(b"\x00\xff torn")
    with pytest.raises(WorkdirInUseError, match="unknown holder"):
        WorkdirLock(str(tmp_path), heartbeat_seconds=10, stale_after_seconds=60).acquire()
    hour_ago = time.time() - 3600
    os.utime(tmp_path / "lock.json", (hour_ago, hour_ago))
    WorkdirLock(str(tmp_path), heartbeat_seconds=10, stale_after_seconds=60).acquire().release()


def test_of_several_processes_taking_over_one_stale_lock_exactly_one_wins(tmp_path):
    write_foreign_lock(tmp_path, age_seconds=3600)
    done, start_at = tmp_path / "done", time.time() + 1.0  # after the interpreters have started
    starters = [start_holder(tmp_path, done_file=done, start_at=start_at) for _ in range(4)]
    try:
        outcomes = [starter.stdout.readline() for starter in starters]
    finally:
        done.touch()
        for starter in starters:
            starter.wait(timeout=30)
    assert outcomes.count("held\n") == 1, outcomes
    winner = starters[outcomes.index("held\n")].pid
    assert all(o.startswith("refused") and f"held by pid {winner} on" in o for o in outcomes if o != "held\n"), outcomes
    assert os.listdir(tmp_path) == ["done"]  # the winner released; no claim or temporary file is left


def test_of_many_threads_taking_over_one_stale_lock_exactly_one_wins(tmp_path):
    """The same race in-process, many times: a thread sees another's lock as held by this (live) process."""
    for attempt in range(10):
        directory = tmp_path / str(attempt)
        directory.mkdir()
        write_foreign_lock(directory, age_seconds=3600)
        winners, barrier = [], threading.Barrier(6)

        def take():
            lock = WorkdirLock(str(directory), heartbeat_seconds=10, stale_after_seconds=60)
            barrier.wait()
            try:
                winners.append(lock.acquire())
            except WorkdirInUseError:
                pass

        threads = [threading.Thread(target=take) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(winners) == 1
        assert json.loads((directory / "lock.json").read_text())["token"] == winners[0].record["token"]
        assert winners[0].release() and not os.listdir(directory)


def test_the_heartbeat_advances_and_release_removes_only_our_own_lock(tmp_path, warnings):
    lock = WorkdirLock(str(tmp_path), heartbeat_seconds=0.05, stale_after_seconds=1).acquire()
    first = json.loads((tmp_path / "lock.json").read_text())["heartbeat"]
    time.sleep(0.3)
    assert json.loads((tmp_path / "lock.json").read_text())["heartbeat"] > first
    with pytest.raises(WorkdirInUseError, match=r"held by this process"):
        WorkdirLock(str(tmp_path)).acquire()
    # Another job takes the lock over (as if it had judged this one stale); replaced in one rename, so the
    # heartbeat thread cannot catch the moment between.
    (tmp_path / "new").mkdir()
    write_foreign_lock(tmp_path / "new")
    os.replace(tmp_path / "new" / "lock.json", tmp_path / "lock.json")
    with pytest.raises(WorkdirLockLost, match="now held by pid 4242 on another-host.example"):
        lock.check()
    assert not lock.release()
    assert json.loads((tmp_path / "lock.json").read_text())["pid"] == 4242
    assert "no longer this process's lock" in warnings.text


WRITER = """
import sys
from transformer.files import write_json
from transformer.restore import restore
for i in range(10**9):
    write_json(sys.argv[1], {"i": i, "pad": "x" * 1_000_000})
"""


@pytest.mark.parametrize("delay", [0.05, 0.2])
def test_a_killed_writer_leaves_a_whole_json_file(tmp_path, delay):
    path = tmp_path / "record.json"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)])
    try:
        while not path.exists() and writer.poll() is None:
            time.sleep(0.01)
        time.sleep(delay)
    finally:
        writer.kill()
        writer.wait()
    record = files.read_json(str(path))
    assert record["i"] >= 0 and record["pad"] == "x" * 1_000_000


def test_read_json_is_empty_when_absent_and_names_a_damaged_file(tmp_path, warnings):
    assert files.read_json(str(tmp_path / "absent.json")) == {}
    assert files.read_json(str(tmp_path / "absent.json"), default=None) is None
    files.write_json(str(tmp_path / "run.json"), {"batch": {"rows": 8}})
    assert files.read_json(str(tmp_path / "run.json")) == {"batch": {"rows": 8}}
    (tmp_path / "run.json").write_text('{"batch": {"ro')
    with pytest.raises(files.DamagedFileError, match=r"run.json is not valid JSON \(.*line 1 column"):
        files.read_json(str(tmp_path / "run.json"))
    assert files.read_json(str(tmp_path / "run.json"), default={"peak": 0}, cache=True) == {"peak": 0}
    assert "run.json is not valid JSON" in warnings.text


@pytest.fixture(scope="module")
def two_vocabularies(tmp_path_factory):
    """Two real sentencepiece models of the same size, trained on different slices of the built-in corpus."""
    directory = tmp_path_factory.mktemp("vocabularies")
    models = []
    for seed in (0, 1):
        pairs = data.read_split(data.DataConfig(builtin_train_size=300, builtin_seed=seed), "train")
        models.append(train_tokenizer([text for pair in pairs for text in pair], str(directory / f"{seed}.model"),
                                      vocab_size=100))
    return models


def test_check_vocabulary_refuses_another_model_of_the_same_size(two_vocabularies):
    first, second = two_vocabularies
    assert first.vocab_size == second.vocab_size == 100
    recorded = workdir.vocabulary_record(first.path, first.vocab_size)
    assert recorded == {"file": "0.model", "sha256": workdir.fingerprint(first.path), "pieces": 100}
    workdir.check_vocabulary(recorded, first.path)
    workdir.check_vocabulary(None, second.path)  # a first start: nothing recorded yet
    with pytest.raises(VocabularyMismatchError) as refused:
        workdir.check_vocabulary(recorded, second.path)
    assert isinstance(refused.value, DataError)
    message = str(refused.value)
    assert second.path in message and workdir.fingerprint(second.path) in message and recorded["sha256"] in message


# ----------------------------------------------------------------------------------------------------
# The trainer's use of them: a refused start touches nothing; a replaced vocabulary is refused by resume and eval


def test_a_run_on_a_workdir_another_job_holds_is_refused_before_anything_is_written(tmp_path):
    from tiny import make_tiny_config, tree_digest
    from transformer import trainer

    held = tmp_path / "w"
    holder = start_holder(held, done_file=tmp_path / "done")
    try:
        assert holder.stdout.readline().strip() == "held"
        before = tree_digest(held)
        with pytest.raises(WorkdirInUseError, match=rf"pid {holder.pid} on {socket.gethostname()}"):
            trainer.Run(make_tiny_config(), str(held))
        assert tree_digest(held) == before
    finally:
        (tmp_path / "done").write_text("")
        holder.wait(timeout=60)


def test_resume_and_eval_refuse_a_vocabulary_that_is_not_the_runs(tmp_path):
    from tiny import make_tiny_config
    from transformer import trainer
    from transformer.restore import restore

    config = make_tiny_config(**{"train.num_train_steps": 3, "decode.bleu_splits": ""})
    run_dir = tmp_path / "run"
    trainer.Run(config, str(run_dir)).train()
    recorded = json.loads((run_dir / "run.json").read_text())["vocabulary"]
    assert recorded["sha256"] == workdir.fingerprint(str(run_dir / "vocab.model")) and recorded["pieces"] == 300
    pairs = data.read_split(data.DataConfig(builtin_train_size=2000, builtin_seed=7), "train")
    other = train_tokenizer([text for pair in pairs for text in pair], str(tmp_path / "other.model"), vocab_size=300)
    (run_dir / "vocab.model").write_bytes(open(other.path, "rb").read())  # the same size, other pieces
    with pytest.raises(VocabularyMismatchError, match="vocab.model"):
        trainer.Run(make_tiny_config(), str(run_dir))
    with pytest.raises(VocabularyMismatchError, match="vocab.model"):
        restore(str(run_dir))


def test_a_given_vocabulary_is_copied_in_and_config_json_has_the_size_the_model_has(tmp_path):
    from tiny import make_tiny_config
    from transformer import trainer

    pairs = data.read_split(data.DataConfig(builtin_train_size=2000, builtin_seed=3), "train")
    given = train_tokenizer([text for pair in pairs for text in pair], str(tmp_path / "given.model"), vocab_size=280)
    config = make_tiny_config(**{"data.vocab_path": given.path, "data.vocab_size": 500, "train.num_train_steps": 3,
                                 "decode.bleu_splits": ""})
    run_dir = tmp_path / "run"
    trainer.Run(config, str(run_dir)).train()
    assert (run_dir / "vocab.model").read_bytes() == open(given.path, "rb").read()
    assert json.loads((run_dir / "config.json").read_text())["data"]["vocab_size"] == 280
    config.train.num_train_steps = 6
    assert int(trainer.Run(config, str(run_dir)).state.step) == 3  # the same run: resumed, not refused
