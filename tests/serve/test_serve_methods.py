"""Every method behind `vpsd serve`'s app, called by OpenAI's client over HTTP on 127.0.0.1: plain and streamed
answers are `ar`'s text, greedy and sampled at a seed. Each method decodes in the server's process (a parallel
method's draft and pruner on threads: serve/online.py's continuous batching), at batch 2 so that requests join a
batch; the same parallel methods on ranks: test_serve_ranks.py (child ranks) and test_serve_torchrun.py (a launch's
pipelines)."""

from __future__ import annotations

import threading

import pytest

import vpsd
from tests.serve.conftest import app_in_thread
from tests.serve.test_serve import CONFIG, ITEMS, MAX_TOKENS, SAMPLED, _messages, _video_part
from vpsd.pipeline.methods import METHODS

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_answers_as_ar_plain_streamed_and_sampled(method, ar, tmp_path):
    from vpsd.serve.app import ServeSettings, create_app
    from vpsd.serve.jobs import JobQueue
    from vpsd.serve.metrics import Metrics
    from vpsd.serve.online import OnlineEngine

    batch = 1 if method == "tabed" else 2  # TABED's ensemble runs one item at a time
    with vpsd.LLM(CONFIG, method=method, batch=batch, draft_on="thread") as llm:
        assert not llm.served
        metrics = Metrics("world_qwen2_5_vl")
        runner = OnlineEngine(llm, JobQueue(8, batch, metrics))
        app = create_app(llm, runner, ServeSettings("world_qwen2_5_vl", method, scratch=tmp_path), metrics)
        with app_in_thread(app, runner) as base:
            _check(openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120), method, ar)


def _check(client, method: str, ar: dict) -> None:
    def ask(item: dict, **kw):
        return client.chat.completions.create(model="world_qwen2_5_vl", max_tokens=MAX_TOKENS,
                                              messages=_messages(item["prompt"], _video_part(item)), **kw)

    answers = {}
    pool = [threading.Thread(target=lambda it=it: answers.setdefault(it["id"], ask(it))) for it in ITEMS]
    for t in pool:  # together: the second joins the first's batch
        t.start()
    for t in pool:
        t.join(120)
    assert {k: r.choices[0].message.content for k, r in answers.items()} == {it["id"]: ar[it["id"]] for it in ITEMS}
    assert all(r.usage.vpsd["method"] == method for r in answers.values())
    if method != "ar":  # it speculated: rounds committed more than one token
        assert max(r.usage.vpsd["mean_accepted_tokens"] for r in answers.values()) > 1
    chunks = list(ask(ITEMS[0], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ar[ITEMS[0]["id"]]
    sampled = ask(ITEMS[1], seed=2, **SAMPLED)
    assert sampled.choices[0].message.content == ar["sampled2"]
