"""A full disk: files of a run directory end on whole lines and the error names the directory.

ENOSPC is injected into the writer's os.write (half the bytes land, then the device is full), as a real full
disk does; a job on a real full tmpfs was checked by hand (the issue's report)."""

from __future__ import annotations

import errno
import json
import os

import pytest

import vpsd.storage
from vpsd.launch.results import ResultRow, ResultsFile
from vpsd.storage import DiskFull, LineFile
from vpsd.tracing import close_tracing, configure_tracing, get_logger, span


@pytest.fixture
def full_disk(monkeypatch):
    """After `arm()`, every os.write in vpsd.storage writes half its bytes and then fails with ENOSPC."""
    real = os.write
    state = {"armed": False}

    def write(fd, data):
        if not state["armed"]:
            return real(fd, data)
        if len(data) > 1 and not state.get("half_done"):
            state["half_done"] = True
            return real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(vpsd.storage.os, "write", write)
    return lambda armed=True: state.update(armed=armed, half_done=False)


def test_results_stay_whole_and_the_error_names_the_directory(tmp_path, full_disk):
    results = ResultsFile(tmp_path)
    results.append(ResultRow.from_json({"id": "a", "method": "ar", "error": None}))
    before = (tmp_path / "results.jsonl").read_bytes()
    full_disk()
    with pytest.raises(DiskFull) as info:
        results.append(ResultRow.from_json({"id": "b", "method": "ar", "error": None, "text": "x" * 1000}))
    assert str(tmp_path) in str(info.value) and "rerun the same command" in str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert (tmp_path / "results.jsonl").read_bytes() == before
    assert results.finished("ar") == {"a"}


def test_a_trace_ends_on_a_whole_line(tmp_path, full_disk):
    configure_tracing(tmp_path, "target", 0)
    try:
        get_logger().info("before", n=1)
        with span("verify", item="x"):
            pass
        full_disk()
        with pytest.raises(DiskFull):
            get_logger().info("cut", payload="y" * 4000)
        with pytest.raises(DiskFull):
            with span("verify", item="x", payload="z" * 4000):
                pass
    finally:
        close_tracing()
    data = (tmp_path / "traces" / "rank0_target.jsonl").read_text()
    assert data.endswith("\n")
    assert [json.loads(line)["event"] for line in data.splitlines()] == ["before", "span"]


def test_a_line_file_appends_after_a_failed_write(tmp_path, full_disk):
    with LineFile(tmp_path / "f.jsonl") as f:
        f.write("one\n")
        full_disk()
        with pytest.raises(DiskFull):
            f.write("two two two\n")
    full_disk(False)
    with LineFile(tmp_path / "f.jsonl") as f:  # room again
        f.write("three\n")
    assert (tmp_path / "f.jsonl").read_text() == "one\nthree\n"
