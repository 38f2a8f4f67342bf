"""The serving tests' reference: `ar` through the Python API at batch 1, once a session (a worker's), the texts
every server answer is held to."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

import pytest

import vpsd
from tests.serve.test_serve import CONFIG, ITEMS, MAX_TOKENS, SAMPLED, WORLD, _frames


@pytest.fixture(scope="session")
def ar_llm():
    with vpsd.LLM(CONFIG, method="ar") as llm:
        yield llm


@pytest.fixture(scope="session")
def ar(ar_llm):
    """`ar` through the Python API, batch 1: the texts every server answer is held to (by key)."""
    requests = [vpsd.VideoRequest(str(WORLD / it["video"]), it["prompt"], id=it["id"]) for it in ITEMS]
    requests.append(vpsd.VideoRequest(_frames(), "Describe the video.", id="frames"))
    llm = ar_llm
    plain = {o.id: o.text for o in llm.generate(requests, vpsd.SamplingParams(max_new_tokens=MAX_TOKENS))}
    cut = llm.generate(requests[0], vpsd.SamplingParams(max_new_tokens=MAX_TOKENS, stop=["square"]))[0].text
    sampled = {seed: llm.generate(requests[1], vpsd.SamplingParams(max_new_tokens=MAX_TOKENS, seed=seed,
                                                                   **SAMPLED))[0].text for seed in (1, 2)}
    assert "square" not in cut and plain[ITEMS[0]["id"]].startswith(cut) and cut != plain[ITEMS[0]["id"]]
    assert sampled[1] != sampled[2]  # the seed matters
    return {**plain, "stopped": cut, **{f"sampled{seed}": text for seed, text in sampled.items()}}


@contextlib.contextmanager
def app_in_thread(app, runner) -> Iterator[str]:
    """The app served by uvicorn on 127.0.0.1 (a free port) in a thread of this process; yields its /v1 base URL, then
    stops the server and its runner (which must close within 10 s)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(10)
        assert runner.close(10)
