"""`./torchrun.sh serve` (serve/launched.py), one pipeline (pearl: target, draft and pruner ranks): the target
rank's prefix cache (engine/prefix_cache.py), which lives in that rank's process, is on the server's /metrics, its
counters carried by each result the target sends (launch/job.py, `ItemResult.reuse`). Absent before any answer;
two questions about one video -> one miss, then one hit that took the video's prefix from the cache (reused tokens
> 0); the first question again -> a second hit, the same text; the bytes held are within the budget."""

from __future__ import annotations

import signal

import pytest

from tests.serve.test_serve import CONFIG, ITEMS, KEY, WORLD, _get, _messages, running_server
from tests.torchrun_jobs import ROOT, job_env

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    args = ["--config", str(CONFIG), "--method", "pearl", "--api-key", KEY, "--allowed-media-dir",
            str(WORLD / "videos"), "--shutdown-timeout", "30"]
    gen = running_server(tmp_path_factory.mktemp("serve_torchrun_reuse") / "server.log", args, 180,
                         env={**job_env(), "NPROC": "3"}, command=[str(ROOT / "torchrun.sh"), "serve"])
    proc = next(gen)
    yield proc
    if proc.poll() is None:  # the ranks leave as a job's do
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, proc.log.read_text()[-3000:]
    gen.close()


def _reuse(server) -> dict[str, float]:
    status, body = _get(f"{server.base}/metrics", key=None)
    assert status == 200
    return {line.split()[0]: float(line.split()[1]) for line in body.decode().splitlines()
            if line.startswith("vpsd_prefix_reuse_")}


def test_the_target_rank_s_prefix_cache_counts_a_second_question_as_a_hit_on_metrics(launched):
    client = openai.OpenAI(base_url=f"{launched.base}/v1", api_key=KEY, max_retries=0, timeout=120)
    assert _reuse(launched) == {}  # no result has carried the target's counters yet
    video = {"type": "video_url", "video_url": {"url": str(WORLD / ITEMS[0]["video"])}}
    texts, seen = [], []
    for question in (ITEMS[0]["prompt"], "What color is the object?", ITEMS[0]["prompt"]):
        r = client.chat.completions.create(model="world_qwen2_5_vl", messages=_messages(question, video), max_tokens=8)
        assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
        texts.append(r.choices[0].message.content)
        seen.append(_reuse(launched))
    first, second, third = seen
    assert (first["vpsd_prefix_reuse_misses_total"], first["vpsd_prefix_reuse_hits_total"]) == (1, 0)
    assert first["vpsd_prefix_reuse_reused_tokens_total"] == 0
    assert (second["vpsd_prefix_reuse_misses_total"], second["vpsd_prefix_reuse_hits_total"]) == (1, 1)
    assert second["vpsd_prefix_reuse_reused_tokens_total"] > 0  # the video's prefix, not prefilled again
    assert third["vpsd_prefix_reuse_hits_total"] == 2
    assert third["vpsd_prefix_reuse_reused_tokens_total"] == 2 * second["vpsd_prefix_reuse_reused_tokens_total"]
    assert texts[2] == texts[0]  # a hit answers as the miss did
    assert 0 < third["vpsd_prefix_reuse_bytes"] <= third["vpsd_prefix_reuse_budget_bytes"]
