"""What a run records of its software stack, and what `vpsd summary` shows of it."""

from __future__ import annotations

import json
from importlib import metadata

from vpsd.provenance import LOCK, changes, describe, lock_pins, off_lock, stack
from vpsd.reports.summary import main as summary_main


def test_lock_pins_read_every_pin_and_skip_comments():
    text = "# header\ntorch==2.13.0             # via vpsd\nTyping_Extensions==4.16.0\n\n-e .\n"
    assert lock_pins(text) == {"torch": "2.13.0", "typing-extensions": "4.16.0"}


def test_off_lock_names_a_package_at_another_release_and_ignores_build_labels():
    torch_version = metadata.version("torch")  # e.g. 2.13.0+cpu: the +cpu label is a build, not a release
    release = torch_version.split("+")[0]
    assert off_lock({"torch": release, "not-installed-anywhere": "1.0"}) == []
    assert off_lock({"torch": "0.0.1"}) == [f"torch {torch_version} (lock 0.0.1)"]


def test_the_repository_lock_pins_torch_and_transformers_and_this_environment_is_read_against_it():
    pins = lock_pins(LOCK.read_text())
    assert {"torch", "transformers", "pyzmq", "msgpack", "av", "pytest"} <= set(pins)
    info = stack()
    assert info["transformers"] == metadata.version("transformers")
    assert len(info["lock_sha256"]) == 64
    assert ("transformers" in " ".join(info["off_lock"])) == (info["transformers"] != pins["transformers"])


def test_describe_and_changes_name_what_moved():
    a = {"vpsd": "0.1.0", "python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.23.0",
         "lock_sha256": "a" * 64, "off_lock": []}
    b = {**a, "transformers": "5.24.0", "off_lock": ["transformers 5.24.0 (lock 5.23.0)"]}
    assert "transformers 5.23.0" in describe(a) and f"lock {'a' * 8} (exact)" in describe(a)
    assert "off it: transformers 5.24.0 (lock 5.23.0)" in describe(b)
    assert changes(a, b) == ["transformers 5.23.0 -> 5.24.0"]
    assert changes(a, a) == []


def _run_dir(path, stack_info):
    path.mkdir()
    row = {"id": "x", "method": "ar", "token_ids": [1, 2], "error": None,
           "stats": {"rounds": 2, "wall_s": 1.0, "decode_s": 0.5, "prefill_s": 0.5, "acceptance_rate": 0.0}}
    (path / "results.jsonl").write_text(json.dumps(row) + "\n")
    (path / "summary.json").write_text(json.dumps({"run": {"total_s": 1.0, "stack": stack_info}}))
    return path


def test_summary_shows_the_stack_and_what_changed_since_the_baseline(tmp_path, capsys):
    a = {"vpsd": "0.1.0", "torch": "2.13.0+cpu", "transformers": "5.23.0", "lock_sha256": "a" * 64, "off_lock": []}
    base = _run_dir(tmp_path / "ar", a)
    run = _run_dir(tmp_path / "run", {**a, "transformers": "5.24.0"})
    assert summary_main([str(run), "--baseline", str(base)]) == 0
    out = capsys.readouterr().out
    assert "transformers 5.24.0" in out
    assert "stack changed" in out and "transformers 5.23.0 -> 5.24.0" in out
    assert json.loads((run / "summary.json").read_text())["run"]["stack"]["transformers"] == "5.24.0"
