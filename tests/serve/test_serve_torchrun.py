"""`./torchrun.sh serve`: vpsd serve on a launch's ranks, rank 0 serving HTTP (serve/launched.py). Two pipelines
(pearl, 3 ranks each: what a multi-GPU node runs) behind one server, called by OpenAI's client:
- a burst of 8 requests from 4 threads is answered once each, each equal to `ar`'s batch-1 text, and both
  pipelines decode some; a streamed one comes in pieces as the ranks' rounds commit and joins to the plain text;
- a request whose sampling settings are not the launch's is a 400 that says so, and the server goes on;
- SIGTERM to ./torchrun.sh: the request in flight finishes, every rank leaves, exit 0 with one line."""

from __future__ import annotations

import signal
import subprocess
import threading

import pytest

from tests.serve.test_serve import CONFIG, ITEMS, KEY, _ask, _burst, _streams_as_ar, running_server
from tests.torchrun_jobs import ROOT, job_env

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    # Two pipelines on this 2-core machine: unpinned (the config pins one pipeline's roles to cores 0 and 1).
    args = ["--config", str(CONFIG), "--method", "pearl", "--api-key", KEY, "--shutdown-timeout", "30",
            "--set", "cpu_affinity=null"]
    yield from running_server(tmp_path_factory.mktemp("serve_torchrun") / "server.log", args, 180,
                              env={**job_env(), "NPROC": "6"}, command=[str(ROOT / "torchrun.sh"), "serve"])


@pytest.fixture(scope="module")
def client(launched):
    return openai.OpenAI(base_url=f"{launched.base}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_two_pipelines_answer_a_burst_once_each_as_ar_and_stream_as_they_commit(launched, client, ar):
    assert "2 pipelines under torchrun" in launched.log.read_text()
    answers = _burst(client, 8, 4, ar)
    assert {r.usage.vpsd["pipeline"] for r in answers} == {0, 1}
    assert max(r.usage.vpsd["batch_size"] for r in answers) == 2  # both pipelines decoding at once
    _streams_as_ar(client, ar)


def test_other_sampling_settings_are_refused_and_the_server_goes_on(client, ar):
    with pytest.raises(openai.BadRequestError, match="sample as the launch set them"):
        _ask(client, ITEMS[1], temperature=0.7, seed=1)
    assert _ask(client, ITEMS[1]).choices[0].message.content == ar[ITEMS[1]["id"]]


def test_sigterm_finishes_the_request_in_flight_and_every_rank_leaves_with_exit_0(launched, client, ar):
    got = {}
    asking = threading.Thread(target=lambda: got.setdefault("r", _ask(client, ITEMS[0])))
    asking.start()
    import time

    time.sleep(0.3)  # the request is in flight
    launched.send_signal(signal.SIGTERM)
    asking.join(120)
    assert got["r"].choices[0].message.content == ar[ITEMS[0]["id"]]
    assert launched.wait(90) == 0, launched.log.read_text()[-3000:]
    assert "serve: stopped by SIGTERM" in launched.log.read_text()
    left = subprocess.run(["pgrep", "-f", f"vpsd.launch.entry serve.*{launched.base.rsplit(':', 1)[1]}"],
                          capture_output=True, text=True).stdout.split()
    assert not left, f"ranks still running: {left}"
