"""What a rank's heartbeats say it is doing, and the limit past which a peer calls it stuck (vpsd/activity.py)."""

from __future__ import annotations

import threading
import time

from vpsd.activity import STUCK_FACTOR, Activity, stuck_limit


def test_reports_the_role_threads_phase_and_what_such_work_took_per_unit_of_size():
    a = Activity()
    a.own("target")
    assert a.report().phase == ""
    t0 = time.monotonic()
    with a.doing("prefill", "x", size=100):
        time.sleep(0.05)
        now = a.report()
        assert (now.phase, now.item, now.typical_s) == ("prefill", "x", 0.0)  # none finished yet
        assert now.busy_s >= 0.04
    first = time.monotonic() - t0
    with a.doing("prefill", "y", size=400):  # four times the tokens: four times what the first took
        now = a.report()
        assert 4 * 0.05 <= now.typical_s <= 4 * first
    assert a.report().phase == ""


def test_work_on_other_threads_is_not_the_roles():
    a = Activity()
    a.own("target")
    seen = []

    def prefill_ahead():
        with a.doing("prefill", "next", size=10):
            seen.append(a.report().phase)

    t = threading.Thread(target=prefill_ahead)
    t.start()
    t.join()
    assert seen == [""]  # the role's own thread was in no phase meanwhile


def test_the_limit_scales_what_this_job_measured_with_a_floor_and_waits_idle_timeout_before_any():
    assert stuck_limit(0.0, timeout_s=5.0, idle_timeout_s=3600.0) == 3600.0
    assert stuck_limit(0.1, timeout_s=5.0, idle_timeout_s=3600.0) == 5.0  # 10 x 0.1 s is under --timeout
    assert stuck_limit(2.0, timeout_s=5.0, idle_timeout_s=3600.0) == STUCK_FACTOR * 2.0


def test_loading_the_models_has_the_start_up_bound_whatever_other_work_took():
    assert stuck_limit(0.0, timeout_s=5.0, idle_timeout_s=3600.0, phase="start", startup_timeout_s=600.0) == 600.0
    assert stuck_limit(2.0, timeout_s=5.0, idle_timeout_s=3600.0, phase="start", startup_timeout_s=30.0) == 30.0


def test_a_named_point_is_stalled_by_the_slow_hook_only_the_nth_time_and_only_on_the_roles_thread(monkeypatch):
    monkeypatch.setenv("VPSD_TEST_SLOW", "target:signals-sent:2:0.2")
    a = Activity()
    a.own("target")

    def took() -> float:
        t0 = time.monotonic()
        a.passing("signals-sent")
        return time.monotonic() - t0

    assert took() < 0.1  # the first time: not the one named
    t = threading.Thread(target=a.passing, args=("signals-sent",))  # another thread's passing counts for nothing
    t.start()
    t.join()
    assert took() >= 0.2  # the second, on the role's thread
    assert took() < 0.1
