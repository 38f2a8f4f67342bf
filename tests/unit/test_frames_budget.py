"""The frame cache's budget (video/frame_cache.py, `reuse.frames_mib`): checked by the config, counted by the memory
plan on the host ranks that read videos (the target's; a draft rank's when it reads its own, video.share_frames
false; never against a GPU), and its counters summed over pipelines and printed by `vpsd summary`."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.conftest import config_path
from vpsd.config import load_config
from vpsd.launch.cli import main as cli_main
from vpsd.launch.coordinator import _summed
from vpsd.launch.memory import launch_plan
from vpsd.launch.results import ResultRow, ResultsFile
from vpsd.models.memory_plan import describe
from vpsd.pipeline.methods import get_method
from vpsd.reports.summary import job_summary

MIB = 2**20


def test_the_budget_is_a_number_at_least_zero_and_off_with_reuse():
    cfg = load_config(config_path("qwen2_5_vl"))
    assert cfg.reuse.frames_mib == 128 and cfg.reuse.frames_bytes == 128 * MIB
    assert load_config(config_path("qwen2_5_vl"), {"reuse.frames_mib": 0}).reuse.frames_bytes == 0
    assert load_config(config_path("qwen2_5_vl"), {"reuse.enabled": False}).reuse.frames_bytes == 0
    for bad in (-1, True, "lots"):
        with pytest.raises(ValueError, match="reuse.frames_mib"):
            load_config(config_path("qwen2_5_vl"), {"reuse.frames_mib": bad})


def needs(**settings) -> dict[str, object]:
    cfg = load_config(config_path("qwen2_5_vl"), settings)
    return {n.role: n for n in launch_plan(cfg, get_method("hippo")).needs}


def test_the_plan_counts_the_budget_on_the_host_ranks_that_read_videos():
    """The frames, and as much again for the last video's prepared pixels (models/pixel_memo.py) a model there
    that embeds it: the target's rank holds the target; a draft rank reading its own videos, the draft."""
    plan = needs()
    assert plan["target"].frames == 2 * 128 * MIB and plan["draft"].frames == 0 and plan["pruner"].frames == 0
    assert plan["target"].fixed - needs(**{"reuse.frames_mib": 0})["target"].fixed == 2 * 128 * MIB
    assert "+ frames cache 0.2 GiB" in describe(plan["target"], 1024)
    assert needs(**{"video.share_frames": False})["draft"].frames == 2 * 128 * MIB  # it reads the files itself
    assert needs(**{"reuse.enabled": False})["target"].frames == 0


def test_a_gpu_rank_s_budget_is_not_counted_against_its_gpu():
    cfg = load_config(config_path("qwen2_5_vl"))
    cfg = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, device="cuda:0"))
    target = next(n for n in launch_plan(cfg, get_method("ar")).needs if n.role == "target")
    assert target.frames == 0


def test_summary_json_sums_and_vpsd_summary_prints_the_frame_cache(tmp_path, capsys):
    one = {"reads": 6, "hits": 3, "joined": 1, "misses": 2, "bytes": 10 * MIB, "budget_bytes": 256 * MIB}
    summed = _summed([one, None, one])
    assert summed["reads"] == 12 and summed["bytes"] == 20 * MIB and _summed([None]) is None
    stats = {"rounds": 1, "acceptance_rate": 0.0, "wall_s": 1.0, "prefill_s": 0.1, "decode_s": 0.9}
    row = {"id": "a", "method": "m", "token_ids": [1], "stats": stats, "error": None}
    ResultsFile(tmp_path).append(ResultRow.from_json(row))
    (tmp_path / "summary.json").write_text(json.dumps(job_summary(tmp_path, "m", {"items": 1,
                                                                                  "frames_cache": summed})))
    assert cli_main(["summary", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(None, 2)[2] for line in lines if line.startswith("frames cache")] == [
        "8 hits / 12 reads (67%), 4 misses, 20 MiB held"]
    assert not any("joined=" in line for line in lines)  # not repeated in the run's line
