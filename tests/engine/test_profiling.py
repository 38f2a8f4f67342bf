"""A profile of a job's rounds where they run (vpsd/profiling.py, `profile_rounds: N`): the profiler's trace and
the split of the rounds' time, written beside the rank's trace, from the engine's own loop."""

from __future__ import annotations

import json

from tests.conftest import tiny_pair
from tests.engine_harness import local_engine, requests, run
from vpsd.config import DecodingConfig
from vpsd.profiling import RoundProfile


def test_the_profiled_rounds_are_split_into_kernels_launches_waits_and_the_rest(tmp_path):
    target, _ = tiny_pair("qwen2_5_vl")
    engine, scheduler = local_engine(target, None, DecodingConfig(max_new_tokens=20), None, 2)
    profile = RoundProfile(tmp_path, "target", 0, rounds=4, cuda=False, skip=2)
    scheduler.on_round = profile.step
    run(scheduler, requests(2, max_new=20))
    profile.close()
    summary = json.loads((tmp_path / "traces" / "profile_rank0_target.summary.json").read_text())
    assert summary["rounds"] == 4 and summary["wall_s"] > 0 and summary["device_s"] > 0
    assert summary["launch_s"] == summary["host_wait_s"] == 0.0  # a CPU has neither
    per = summary["per_round_ms"]
    assert abs(per["wall"] - per["device"] - per["other"]) < 1e-6  # the rest is what the ops' own time is not
    assert summary["aten_ops_per_round"] > 100 and summary["top"][0]["calls"] > 0
    assert (tmp_path / "traces" / "profile_rank0_target.json").stat().st_size > 0
