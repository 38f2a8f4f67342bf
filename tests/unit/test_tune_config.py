"""A tuned config (vpsd/launch/tuned.py): what `vpsd tune` writes, `--method auto` reading its choice (the job's
command line, the Python API), and a config tuned on another pair or machine refused at launch, naming what
differs. No model loads here: the settings are checked as a launch checks them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vpsd.config import ConfigError, load_config
from vpsd.launch.tuned import Choice, auto_choice, tuned_problems, write_tuned

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_qwen2_5_vl.yaml"
WORLD = ROOT / "configs" / "world_qwen2_5_vl.yaml"  # checkpoints: their weights are hashed

SD = {"pruning.strategy": "none", "pruning.ratio": 0.0, "decoding.gamma": 3, "batching.size": 1}
HIPPO8 = {"pruning.strategy": "random", "pruning.ratio": 0.75, "decoding.gamma": "auto", "batching.size": 8,
          "draft_on": "rank", "batching.pipelined": False}


def tuned(tmp_path: Path, source: Path = TINY, sets: list[str] = ()) -> Path:
    cfg = load_config(source, {"tuned": None})
    choices = [{"batch": 1, "method": "sd", "settings": SD, "items_per_hour": 100.0, "x_ar": 1.2, "noise": 0.01},
               {"batch": 8, "method": "hippo", "settings": HIPPO8, "items_per_hour": 300.0, "x_ar": 1.1, "noise": 0.0}]
    return write_tuned(source, tmp_path / "sub" / "tuned.yaml", list(sets), Choice("hippo", 8, HIPPO8), choices, cfg,
                       {"report": "r.txt"})


def test_the_tuned_config_is_the_users_with_the_winners_keys_and_its_block(tmp_path):
    path = tuned(tmp_path, sets=["decoding.max_new_tokens=12"])
    data = yaml.safe_load(path.read_text())
    assert data["pruning"] == {"strategy": "random", "ratio": 0.75}
    assert data["decoding"]["gamma"] == "auto" and data["decoding"]["max_new_tokens"] == 12  # the tune's --set too
    assert data["batching"] == {"size": 8, "pipelined": False} and data["draft_on"] == "rank"
    block = data["tuned"]
    assert (block["method"], block["batch"]) == ("hippo", 8) and [c["batch"] for c in block["choices"]] == [1, 8]
    assert block["machine"]["cores"] >= 1 and block["pair"]["target"]["tiny"]["seed"] == 0
    assert block["source"]["sets"] == ["decoding.max_new_tokens=12"]
    cfg = load_config(path)  # a valid config, `tuned` a known key
    assert cfg.tuned["method"] == "hippo" and not tuned_problems(cfg)


def test_checkpoint_paths_still_point_at_the_checkpoints_from_where_the_tuned_config_lies(tmp_path):
    path = tuned(tmp_path, WORLD)
    assert load_config(path).target.path == load_config(WORLD).target.path
    block = yaml.safe_load(path.read_text())["tuned"]
    assert block["pair"]["target"]["weights"] and "path" not in block["pair"]["target"]  # the hash, not the place


def test_auto_picks_the_winner_or_the_choice_at_the_batch_asked(tmp_path):
    cfg = load_config(tuned(tmp_path))
    assert auto_choice(cfg) == Choice("hippo", 8, HIPPO8)
    one = auto_choice(cfg, 1)
    assert (one.method, one.option("gamma"), one.option("pruning"), one.sets()) == ("sd", 3, "none", [])
    assert auto_choice(cfg, 8).sets() == ["draft_on=rank", "batching.pipelined=false"]
    with pytest.raises(ConfigError, match="tuned at batch 1, 8 only"):
        auto_choice(cfg, 4)
    with pytest.raises(ConfigError, match="has no tuned: block"):
        auto_choice(load_config(TINY))


def test_a_config_tuned_on_another_pair_or_machine_is_refused_naming_what_differs(tmp_path):
    from vpsd.launch.settings import run_config

    path = tuned(tmp_path)
    with pytest.raises(ConfigError) as e:  # another target: its spec differs from the one tuned
        run_config(path, "ar", overrides=["target.tiny.seed=7"], local_world=1)
    assert "tuned on another pair or machine (pair.target.tiny.seed: 0 -> 7)" in str(e.value)
    data = yaml.safe_load(path.read_text())
    data["tuned"]["machine"]["cores"] = 999
    data["tuned"]["machine"]["gpus"] = ["NVIDIA H200"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        run_config(path, "sd", local_world=1)
    assert "machine.cores: 999 -> " in str(e.value) and "machine.gpus: ['NVIDIA H200'] -> []" in str(e.value)
    assert run_config(path, "sd", overrides=["tuned=null"], local_world=1).tuned is None  # run it anyway


def test_weights_changed_in_place_are_another_pair(tmp_path):
    """A checkpoint replaced under the same path: its sampled hash differs (launch/job_identity.py)."""
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(Path(load_config(WORLD).target.path), src)
    path = tuned(tmp_path, WORLD, sets=[f"target.path={src}"])
    assert not tuned_problems(load_config(path))
    weights = next(src.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-8] + b"\x01" * 8)
    (problem,) = tuned_problems(load_config(path))
    assert "pair.target.weights: " in problem


def test_method_auto_on_the_job_command_line_runs_the_choice(tmp_path, capsys):
    """./torchrun.sh run --method auto: each rank reads the choice before anything starts (launch/arguments.py);
    an option given wins over the choice's; a config without a choice is refused in one line."""
    from vpsd.launch.arguments import parse_args

    path = tuned(tmp_path)
    base = ["--config", str(path), "--manifest", "m.jsonl", "--out", str(tmp_path / "o"), "--method", "auto"]
    a = parse_args(base)
    assert (a.method, a.pruning, a.ratio, a.gamma, a.batch) == ("hippo", "random", 0.75, "auto", 8)
    assert a.set == ["draft_on=rank", "batching.pipelined=false"]
    assert "--method auto: hippo (pruning random 0.75, gamma auto, batch 8" in capsys.readouterr().err
    a = parse_args(base + ["--batch", "1", "--gamma", "5"])
    assert (a.method, a.pruning, a.gamma, a.batch) == ("sd", "none", 5, 1)
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(TINY), "--manifest", "m", "--out", str(tmp_path / "o"), "--method", "auto"])
    assert e.value.code == 2 and "has no tuned: block" in capsys.readouterr().err


def test_the_python_api_reads_the_choice_before_any_model_loads(tmp_path):
    from vpsd.api import _auto

    path = tuned(tmp_path)
    assert _auto(path, 1, {}).method == "sd"  # tuned at the batch asked
    assert _auto(str(path), 8, {}).method == "hippo"
    data = yaml.safe_load(path.read_text())
    data["tuned"]["choices"] = data["tuned"]["choices"][1:]  # tuned at 8 alone: batch=1, the default, is the winner's
    path.write_text(yaml.safe_dump(data))
    assert _auto(path, 1, {}) == Choice("hippo", 8, HIPPO8)
    with pytest.raises(ConfigError, match="tuned at batch 8 only"):
        _auto(path, 4, {})
    with pytest.raises(ConfigError, match="no tuned: block"):  # --set tuned=null: none to run
        _auto(path, 1, {"tuned": None})
    with pytest.raises(ConfigError, match="no tuned: block"):
        _auto(TINY, 1, {})
    with pytest.raises(ConfigError, match="no such config file"):
        _auto(tmp_path / "nope.yaml", 1, {})


def test_auto_on_a_config_never_tuned_tunes_once_on_the_jobs_first_items(tmp_path, monkeypatch):
    """./torchrun.sh run --method auto, config untuned (vpsd/bench/tune for_job): a tune on the job's first items into
    OUT/tuned.yaml, the job on it; the same command again reuses it (so the job resumes with the same choice)."""
    import vpsd.bench.tune as tune

    calls = []

    def fake_tune(a):
        calls.append(a)
        return write_tuned(a.config, a.out, list(a.set), Choice("sd", 1, SD), [], load_config(a.config), {})

    monkeypatch.setattr(tune, "tune", fake_tune)
    out = tmp_path / "job"
    job = ["--config", str(TINY), "--manifest", "m.jsonl", "--out", str(out), "--method", "auto", "--set=video.num_frames=4"]
    made = tune.for_job(job, out)
    assert made[made.index("--config") + 1] == str(out / "tuned.yaml") and made[-1] == "--set=video.num_frames=4"
    assert (calls[0].first, calls[0].items, calls[0].batch, calls[0].set) == (True, 4, [1], ["video.num_frames=4"])
    assert tune.for_job(job, out) == made and len(calls) == 1  # reused
    assert tune.for_job(job[:-1] + ["--set=video.num_frames=2"], out) and len(calls) == 2  # other settings: again
    assert tune.for_job(["--config", str(made[1]), "--method", "auto", "--manifest", "m"], out)[1] == made[1]
    assert tune.for_job([*job[:6], "--method", "hippo"], out) == [*job[:6], "--method", "hippo"]
