"""A rerun resumes only the job whose results its directory holds: other settings stop it, with the reason."""

import json

import pytest

from vpsd.config import load_config
from vpsd.launch.job_identity import JobMismatch, check_resume, differences, record
from vpsd.launch.results import ResultRow, ResultsFile
from tests.torchrun_jobs import ROOT

CONFIG = ROOT / "configs" / "tiny_qwen2_5_vl.yaml"


def _with_results(out, method="hippo", overrides=None):
    cfg = load_config(CONFIG, overrides or {})
    record(out, method, cfg)
    ResultsFile(out).append(ResultRow("a", method, [1], "x", {}))
    return cfg


def test_differences_name_every_changed_leaf():
    old = {"pruning": {"strategy": "hippo", "ratio": 0.9}, "decoding": {"gamma": 4}}
    new = {"pruning": {"strategy": "random", "ratio": 0.9}, "decoding": {"gamma": 4, "seed": 1}}
    assert differences(old, new) == ["decoding.seed: None -> 1", "pruning.strategy: 'hippo' -> 'random'"]
    assert differences(old, old) == []


def test_same_settings_resume(tmp_path):
    cfg = _with_results(tmp_path)
    check_resume(tmp_path, "hippo", cfg)
    # where and how fast it runs is not part of the job
    moved = load_config(CONFIG, {"cpu_affinity": {"target": [0]}, "target.device": "cpu:0"})
    check_resume(tmp_path, "hippo", moved)
    # nor how over-long items are admitted: retrying those failures with subsampling on is a resume
    admitted = load_config(CONFIG, {"video.context_limit": 2048, "video.subsample_to_fit": True})
    check_resume(tmp_path, "hippo", admitted)


def test_a_setting_added_since_counts_as_its_default(tmp_path):
    """A directory recorded before vpsd had `video.sampling`: resumed as long as the run keeps the default."""
    cfg = _with_results(tmp_path)
    jobs = json.loads((tmp_path / "job.json").read_text())
    del jobs["hippo"]["video"]["sampling"]
    (tmp_path / "job.json").write_text(json.dumps(jobs))
    check_resume(tmp_path, "hippo", cfg)
    with pytest.raises(JobMismatch, match="video.sampling: 'config' -> 'checkpoint'"):
        check_resume(tmp_path, "hippo", load_config(CONFIG, {"video.sampling": "checkpoint"}))


@pytest.mark.parametrize("key, value", [("pruning.strategy", "random"), ("decoding.gamma", 2),
                                        ("target.tiny.seed", 7), ("video.num_frames", 4)])
def test_other_settings_stop_the_rerun_and_say_which(tmp_path, key, value):
    _with_results(tmp_path)
    with pytest.raises(JobMismatch, match=key.replace(".", r"\.")) as e:
        check_resume(tmp_path, "hippo", load_config(CONFIG, {key: value}))
    assert "results.jsonl" in str(e.value)  # and how to start over


def test_other_methods_and_empty_results_are_free(tmp_path):
    _with_results(tmp_path, method="ar")
    other = load_config(CONFIG, {"decoding.gamma": 2})
    check_resume(tmp_path, "hippo", other)  # hippo has no results here yet
    record(tmp_path, "hippo", other)
    assert set(json.loads((tmp_path / "job.json").read_text())) == {"ar", "hippo"}
    check_resume(tmp_path, "hippo", load_config(CONFIG))  # recorded, but no hippo rows: nothing to mix with


def test_weights_replaced_in_place_stop_the_rerun(tmp_path):
    """Same path, new weights (a retrain writes over the old checkpoint): the outputs change, so must the job."""
    import shutil

    world = load_config(ROOT / "configs" / "world_qwen2_5_vl.yaml")
    ckpt = tmp_path / "target"
    shutil.copytree(world.target.path, ckpt)
    out = tmp_path / "run"
    cfg = load_config(ROOT / "configs" / "world_qwen2_5_vl.yaml", {"target.path": str(ckpt)})
    record(out, "ar", cfg)
    ResultsFile(out).append(ResultRow("a", "ar", [1], "x", {}))
    check_resume(out, "ar", cfg)
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte in the middle of the tensors
    weights.write_bytes(bytes(data))
    with pytest.raises(JobMismatch, match=r"target\.weights"):
        check_resume(out, "ar", cfg)


def test_a_tabed_section_recorded_as_written_resumes_with_its_defaults_filled(tmp_path):
    """Before tabed was a typed section, job.json held it as the user wrote it (a partial dict, or null)."""
    cfg = _with_results(tmp_path, "tabed", {"tabed.distance": "tvd"})
    jobs = json.loads((tmp_path / "job.json").read_text())
    jobs["tabed"]["tabed"] = {"distance": "tvd"}
    (tmp_path / "job.json").write_text(json.dumps(jobs))
    check_resume(tmp_path, "tabed", cfg)
    with pytest.raises(JobMismatch, match="tabed.distance: 'tvd' -> 'kl'"):
        check_resume(tmp_path, "tabed", load_config(CONFIG, {"tabed.distance": "kl"}))
