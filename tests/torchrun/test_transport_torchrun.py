"""The transport layer under real torchrun: 3 ranks (target, draft, pruner) over gloo + ZeroMQ.

One torchrun launch (module fixture, ~5-8 s) runs tests/workers/transport_worker.py; each rank writes
a JSON file of what it observed, and the tests below assert on those files.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.torchrun_jobs import torchrun_cmd

pytestmark = pytest.mark.torchrun

WORKER = Path(__file__).resolve().parents[1] / "workers" / "transport_worker.py"
WORLD = 3
LAUNCH_TIMEOUT_S = 90  # a hang fails the test instead of hanging CI


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("transport")
    env = dict(os.environ)
    env.pop("VPSD_HOST", None)  # standalone: advertise 127.0.0.1
    cmd = torchrun_cmd(WORLD) + [str(WORKER), str(out)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun hung for {LAUNCH_TIMEOUT_S} s\nstderr:\n{(e.stderr or b'')[-4000:]!r}")
    res = {}
    for r in range(WORLD):
        f = out / f"rank{r}.json"
        if f.exists():
            res[r] = json.loads(f.read_text())
    errors = {r: v["error"] for r, v in res.items() if "error" in v}
    assert proc.returncode == 0 and not errors and len(res) == WORLD, (
        f"rc={proc.returncode} errors={errors}\nstderr tail:\n{proc.stderr[-4000:]}"
    )
    return res


def test_ranks_and_roles(results):
    for r, res in results.items():
        assert res["world"] == WORLD and res["backend"] == "gloo"
        assert res["peer_roles"] == ["target", "draft", "pruner"]
        assert res["address"].startswith("tcp://127.0.0.1:")
    assert len({res["address"] for res in results.values()}) == WORLD


def test_control_ring(results):
    for r, res in results.items():
        for key in ("ring1", "ring2"):  # ring2 runs after the malformed and timeout checks
            assert res[key] == {"src": (r - 1) % WORLD, "ok": True, "type": "DraftChunk"}
        assert (r - 1) % WORLD in res["heard_from"]


def test_announced_tensors(results):
    for r, res in results.items():
        t = res["tensors"]
        assert t["announce"]["src"] == (r - 1) % WORLD
        assert t["announce"]["tag"] == "ring" and t["announce"]["epoch"] == 7
        assert t["announce"]["dtypes"] == ["float32", "int64", "bfloat16", "float32", "int64"]
        assert t["announce"]["shapes"] == [[3, 5], [7], [4, 2], [0, 4], [4, 3]]
        assert t["announce"]["devices"] == ["cpu"] * 5
        assert t["dtypes"] == ["torch.float32", "torch.int64", "torch.bfloat16", "torch.float32", "torch.int64"]
        assert all(t["equal"]), t["equal"]


def test_malformed_messages_dropped_and_logged(results):
    res = results[0]
    # the valid message that followed the garbage on the same socket arrived; nothing bad reached recv
    assert res["after_garbage"] == {"src": 2, "type": "VerifyResult", "item_id": "after-garbage"}
    bad = res["bad_messages"]
    assert len(bad) == res["bad_expected"] == 5
    assert all(b["log_level"] == "warning" and b["peer_address"] == "127.0.0.1" for b in bad)
    assert all(b["sender"] == 2 for b in bad)  # the strangers never passed the handshake: nothing of theirs arrived
    from_rank2 = sorted(b["error"] for b in bad if b["sender"] == 2)
    assert len(from_rank2) == 5
    for text in ("invalid opcode", "must be a msgpack map", "unknown message type 'Nope/1'", "unknown field `exec`",
                 "expected one payload frame"):
        assert any(text in e for e in from_rank2), (text, from_rank2)


def test_recv_timeout_names_the_peer(results):
    t = results[1]["timeout"]
    assert t["raised"] and t["rank"] == 2 and t["role"] == "pruner"
    assert "rank 2 (pruner)" in t["text"]
    assert 0.29 <= t["elapsed"] < 2.0


def test_liveness_check_names_the_silent_peer(results):
    t = results[1]["liveness"]
    assert t["raised"] and t["rank"] == 2 and t["role"] == "pruner" and "rank 2 (pruner)" in t["text"]


def test_round_trip_latency_measured(results):
    rtt = results[0]["rtt_us"]
    print(f"control round trip target<->draft: median {rtt['median']:.0f} us, p90 {rtt['p90']:.0f} us")
    assert 0 < rtt["median"] < 20_000  # loose: 2 shared cores; the point is it is measured, not a benchmark
