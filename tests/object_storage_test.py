"""Workdirs on object storage: the one path layer (transformer/files.py) on a local path and on `gs://` URLs
served by an in-memory filesystem (fsspec's, put behind etils.epath's gs:// backend), and what the run keeps
there: the vocabulary, the token cache, metrics, run records and the workdir lock. Orbax's own gs:// path
(tensorstore's GCS driver) needs the network and is not exercised here."""

import json
import os

import fsspec
import numpy as np
import pytest
from etils.epath import backend, gpath
from tiny import make_tiny_config

from transformer import corpus, data, files, metrics, sharding, token_cache, trainer
from transformer.workdir import WorkdirInUseError, WorkdirLock
from transformer.plan import BatchShape, recorded_batch
from transformer.restore import load_workdir_config
from transformer.settings import Settings
from transformer.workdir import CONFIG_FILE, read_run_file, record_start


class MemoryBackend(backend._FileSystemSpecBackend):
    """epath's fsspec backend over fsspec's in-memory filesystem: what a bucket looks like to the code."""

    def fs(self, path):
        return fsspec.filesystem("memory")

    def glob(self, path):
        return ["gs://" + p.removeprefix("gs:/").lstrip("/") for p in self.fs(path).glob(path)]


@pytest.fixture
def bucket(monkeypatch):
    """gs://bucket, held in memory for one test."""
    memory = fsspec.filesystem("memory")
    monkeypatch.setitem(gpath._PREFIX_TO_BACKEND, "gs", MemoryBackend())
    yield "gs://bucket"
    memory.store.clear()
    memory.pseudo_dirs[:] = [""]


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path):
    """Each path-layer test runs on a local directory and on the in-memory bucket."""
    return str(tmp_path / "root") if request.param == "local" else request.getfixturevalue("bucket") + "/root"


def test_files_write_read_list_and_copy_alike_on_both(root, tmp_path):
    files.make_dirs(f"{root}/eval")
    files.write_json(f"{root}/run.json", {"batch": {"rows": 8}})
    files.write_text(f"{root}/eval/hyp.txt", "a\nb\n")
    assert files.read_json(f"{root}/run.json") == {"batch": {"rows": 8}}
    assert files.read_json(f"{root}/absent.json") == {} and not files.exists(f"{root}/absent.json")
    assert files.read_text(f"{root}/eval/hyp.txt") == "a\nb\n" and files.is_dir(f"{root}/eval")
    assert files.list_dir(root) == ["eval", "run.json"] and files.list_dir(f"{root}/none") == []
    files.write_text(f"{root}/broken.json", '{"half":')
    with pytest.raises(files.DamagedFileError, match="broken.json is not valid JSON"):
        files.read_json(f"{root}/broken.json")
    local = tmp_path / "big.bin"
    local.write_bytes(os.urandom(3 << 20))
    files.publish(str(local), f"{root}/tokens/big.bin")
    files.fetch(f"{root}/tokens/big.bin", str(tmp_path / "back" / "big.bin"))
    assert (tmp_path / "back" / "big.bin").read_bytes() == local.read_bytes()
    assert sorted(os.listdir(tmp_path / "back")) == ["big.bin"]  # no temporary file left beside it


def test_a_local_workdir_is_its_own_local_directory_and_a_url_gets_a_mirror(tmp_path):
    assert files.local_directory(str(tmp_path)) == str(tmp_path)
    mirror = files.local_directory("gs://bucket/runs/base/", str(tmp_path / "cache"))
    assert mirror == str(tmp_path / "cache" / "gs" / "bucket" / "runs" / "base")
    assert files.absolute("gs://bucket/x") == "gs://bucket/x" and files.absolute("x") == os.path.abspath("x")


def settings_with_cache(directory) -> Settings:
    config = make_tiny_config()
    config.data.local_cache_dir = str(directory)
    return Settings.from_config(config)


def test_the_vocabulary_and_token_cache_are_published_and_a_second_host_reads_neither_split(bucket, tmp_path,
                                                                                            drawn):
    workdir = f"{bucket}/run"
    first = trainer.load_corpus(settings_with_cache(tmp_path / "host0"), workdir, ["train", "valid"])
    assert drawn["train"] > 0
    published = files.list_dir(f"{workdir}/tokens")
    assert published == [os.path.basename(first.train_cache.directory)]
    assert set(files.list_dir(f"{workdir}/tokens/{published[0]}")) == {*token_cache.CACHE_FILES, token_cache.SOURCE_FILE}
    assert files.read_bytes(f"{workdir}/vocab.model") == open(first.tokenizer.path, "rb").read()
    assert first.tokenizer.path.startswith(str(tmp_path / "host0"))  # sentencepiece opens a local file
    drawn.clear()
    other = trainer.load_corpus(settings_with_cache(tmp_path / "host1"), workdir, ["train", "valid"])
    assert "train" not in drawn  # fetched, not tokenized again
    assert other.train_cache.directory.startswith(str(tmp_path / "host1"))
    for name in token_cache.CACHE_FILES:
        np.testing.assert_array_equal(np.load(os.path.join(other.train_cache.directory, name)),
                                      np.load(os.path.join(first.train_cache.directory, name)))
    np.testing.assert_array_equal(other.train_kept, first.train_kept)
    assert not os.path.exists(tmp_path / "host1" / "gs" / "bucket" / "run" / "tokens" / "train-text")


def test_a_waiting_process_fetches_the_cache_process_0_published(bucket, tmp_path):
    config = settings_with_cache(tmp_path / "host0").data
    pairs = list(corpus.iter_builtin_split("train", train_size=400))
    tokenizer = data.load_or_train_tokenizer(config, pairs, f"{bucket}/run", process_index=0)
    built = data.load_or_build_token_cache(pairs, tokenizer, f"{bucket}/run", "train", process_index=0,
                                           local_root=str(tmp_path / "host0"))
    waited = data.load_or_build_token_cache(pairs, tokenizer, f"{bucket}/run", "train", process_index=1,
                                            timeout_seconds=5, local_root=str(tmp_path / "host1"))
    assert len(waited) == len(built) == 400 and waited.directory != built.directory
    np.testing.assert_array_equal(waited[7]["inputs"], built[7]["inputs"])


def test_metrics_are_published_and_a_resume_drops_records_after_its_step(bucket, tmp_path):
    workdir = f"{bucket}/run"
    writer = metrics.MetricWriter(workdir, local_root=str(tmp_path / "host0"), publish_seconds=0)
    for step in (10, 20, 30):
        writer.write(step, {"loss": 1.0 / step}, "train")
    assert [r["step"] for r in metrics.read_jsonl(f"{workdir}/metrics.jsonl")] == [10, 20, 30]  # before close
    writer.close()
    assert any(name.startswith("events.") for name in files.list_dir(f"{workdir}/tensorboard"))
    again = metrics.MetricWriter(workdir, resume_step=20, local_root=str(tmp_path / "host1"))
    again.write(30, {"loss": 0.5}, "train")
    again.close()
    records = metrics.read_jsonl(f"{workdir}/metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in records] == [(10, 0.1), (20, 0.05), (30, 0.5)]


def test_run_records_and_the_workdir_config_read_back_from_a_bucket(bucket):
    workdir = f"{bucket}/run"
    settings = Settings.from_config(make_tiny_config())
    batch = BatchShape(8, 16)
    mesh = sharding.make_mesh(settings.mesh)
    record_start(workdir, batch, mesh, settings.train.num_microbatches)
    record_start(workdir, batch, mesh, settings.train.num_microbatches)
    assert recorded_batch(workdir) == batch
    assert len(read_run_file(workdir)["starts"]) == 2
    files.write_text(f"{workdir}/{CONFIG_FILE}", make_tiny_config().to_json())
    assert load_workdir_config(workdir)["data"]["max_length"] == make_tiny_config().data.max_length


def test_the_workdir_lock_on_a_bucket_refuses_a_second_job_and_is_freed(bucket):
    workdir = f"{bucket}/run"
    with WorkdirLock(workdir) as lock:
        holder = json.loads(files.read_text(f"{workdir}/lock.json"))
        assert holder["token"] == lock.record["token"]
        with pytest.raises(WorkdirInUseError, match="is in use"):
            WorkdirLock(workdir).acquire()
        lock.check()  # still ours
    assert not files.exists(f"{workdir}/lock.json")
    WorkdirLock(workdir).acquire().release()  # free again


def test_a_dead_jobs_lock_on_a_bucket_is_taken_over_once_its_heartbeat_is_stale(bucket):
    workdir = f"{bucket}/run"
    stale = {"host": "elsewhere", "pid": 1, "token": "old", "heartbeat": "2020-01-01T00:00:00.000+00:00"}
    files.write_json(f"{workdir}/lock.json", stale)
    lock = WorkdirLock(workdir).acquire()
    try:
        assert json.loads(files.read_text(f"{workdir}/lock.json"))["token"] == lock.record["token"]
    finally:
        lock.release()
