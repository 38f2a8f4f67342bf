"""`vpsd serve` with a parallel method on the API's child ranks (pearl at batch 1: one request a generate call,
serve/batcher.py), --slow: a burst is answered once each as `ar` answers it, plain and streamed; a rank
that dies fails the call in flight or the next with 503, and the request after it is served again on new ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import vpsd
from tests.serve.test_serve import CONFIG, ITEMS, KEY, MAX_TOKENS, WORLD, _ask, _get, _messages, _streamed, _video_part
from tests.torchrun_jobs import ROOT, job_env

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve_ranks") / "server.log"
    cmd = [sys.executable, "-m", "vpsd.launch.cli", "serve", "--config", str(CONFIG), "--method", "pearl",
           "--port", str(port), "--api-key", KEY]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=job_env(), cwd=ROOT)
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.25)
    proc.base, proc.log = f"http://127.0.0.1:{port}", log
    yield proc
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log.read_text()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.base}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ar():
    requests = [vpsd.VideoRequest(str(WORLD / it["video"]), it["prompt"], id=it["id"]) for it in ITEMS]
    with vpsd.LLM(CONFIG, method="ar") as llm:
        return {o.id: o.text for o in llm.generate(requests, vpsd.SamplingParams(max_new_tokens=MAX_TOKENS))}


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(p) for p in out]
    return kids + [d for k in kids for d in _descendants(k)]


def test_a_burst_on_child_ranks_is_answered_once_each_as_ar(client, served, ar):
    assert "child ranks" in served.log.read_text()
    jobs = [ITEMS[n % 2] for n in range(6)]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda item: (item["id"], _ask(client, item)), jobs))
    assert len({r.id for _, r in answers}) == 6
    assert [r.choices[0].message.content for _, r in answers] == [ar[i] for i, _ in answers]
    text, _, _ = _streamed(client, _messages(ITEMS[0]["prompt"], _video_part(ITEMS[0])), max_tokens=MAX_TOKENS)
    assert text == ar[ITEMS[0]["id"]]


def test_a_rank_that_dies_fails_its_call_with_503_and_the_next_request_is_served(client, served, ar):
    ranks = _descendants(served.pid)
    assert ranks, "no child ranks"
    os.kill(ranks[-1], signal.SIGKILL)
    item = ITEMS[0]
    statuses = []
    for _ in range(3):  # the call that meets the dead rank answers 503; one after it starts the ranks again
        try:
            r = _ask(client, item)
        except openai.APIStatusError as e:
            statuses.append(e.status_code)
            assert e.status_code == 503 and e.body["code"] == "engine_failed"
            continue
        statuses.append(200)
        assert r.choices[0].message.content == ar[item["id"]]
        break
    assert statuses[-1] == 200 and 503 in statuses, statuses
