"""`vpsd serve` end to end: one real server (a subprocess, uvicorn on 127.0.0.1, hippo at batch 4 on the embedded
world pair) called by OpenAI's own client, held to `ar` through the Python API.

- plain and streamed completions equal `ar`'s text token for token (greedy, and sampled at a seed), for a video
  sent as a data: URL, as a local path under --allowed-media-dir, and as frames (image_url PNGs, lmms-eval's
  form); streamed chunks join to the plain text and come as rounds commit; stop strings cut both alike;
- a burst of 8 requests from 4 threads: each answered once, each equal to its batch-1 `ar` output;
- refusals are OpenAI error objects and the server goes on: 401 (key), 400 (unsupported fields, top_p, a missing
  video with the job's error kind, bad base64), 403 (a path outside the allowed folder), 404 (another model),
  413 (body and video over the limits);
- /v1/models, /health and /metrics answer; SIGTERM (last): the request in flight finishes, the process exits 0.
"""

from __future__ import annotations

import base64
import io
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import vpsd
from tests.torchrun_jobs import ROOT, job_env
from vpsd.bench.server_process import ServerFailed, start_server

openai = pytest.importorskip("openai")

CONFIG = ROOT / "configs" / "world_qwen2_5_vl.yaml"
WORLD = ROOT / "examples" / "world"
KEY = "test-key"
MAX_TOKENS = 24
SAMPLED = {"temperature": 3.0, "top_p": 0.9}  # hot: this confident pair samples its greedy caption below ~2
STARTUP_S = 120


def _get(url: str, key: str | None = KEY) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def running_server(log, args: list[str], startup_s: float, env: dict | None = None, **kw):
    """A module's server (vpsd/bench/server_process.py), as a fixture yields it: `.base`, `.log`; killed at the end
    unless a test stopped it."""
    try:
        proc, proc.base = start_server(args, log, startup_s, env=env or job_env(), cwd=ROOT, **kw)
    except ServerFailed as e:
        pytest.fail(str(e))
    proc.log = log
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--config", str(CONFIG), "--method", "hippo", "--batch", "4", "--api-key", KEY, "--allowed-media-dir",
            str(WORLD / "videos"), "--max-body-mib", "2", "--max-video-mib", "1", "--shutdown-timeout", "30"]
    yield from running_server(tmp_path_factory.mktemp("serve") / "server.log", args, STARTUP_S)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=KEY, max_retries=0, timeout=60)


ITEMS = [json.loads(line) for line in (WORLD / "manifest.jsonl").read_text().splitlines()[:2]]


def _frames() -> np.ndarray:
    """Four small frames with a moving square: what a client sends as image_url PNGs."""
    frames = np.zeros((4, 56, 84, 3), np.uint8)
    for t in range(4):
        frames[t, 10:30, 10 + 12 * t:30 + 12 * t] = (200, 60 + 40 * t, 30)
    return frames


def _video_part(item: dict) -> dict:
    data = base64.b64encode((WORLD / item["video"]).read_bytes()).decode()
    return {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{data}"}}


def _png(frame: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(text: str, *parts: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


def _ask(client, item: dict, **kw):
    return client.chat.completions.create(model="world_qwen2_5_vl", messages=_messages(item["prompt"], _video_part(item)),
                                          max_tokens=MAX_TOKENS, **kw)


def _streamed(client, messages: list[dict], **kw) -> tuple[str, list, object]:
    chunks = list(client.chat.completions.create(model="world_qwen2_5_vl", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks, chunks[-1].usage


def test_plain_and_streamed_answers_equal_ar(client, ar):
    for item in ITEMS:
        r = _ask(client, item)
        assert r.choices[0].message.content == ar[item["id"]]
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > r.usage.vpsd["num_video_tokens"] > 0
        assert r.usage.vpsd["method"] == "hippo" and r.usage.vpsd["mean_accepted_tokens"] >= 1
        text, chunks, usage = _streamed(client, _messages(item["prompt"], _video_part(item)), max_tokens=MAX_TOKENS)
        assert text == ar[item["id"]]
        assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # as rounds commit them
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
        assert usage.completion_tokens == r.usage.completion_tokens


def test_frames_and_a_local_path_equal_ar(client, ar):
    frames = [{"type": "image_url", "image_url": {"url": _png(f)}} for f in _frames()]
    r = client.chat.completions.create(model="world_qwen2_5_vl", messages=_messages("Describe the video.", *frames),
                                       max_completion_tokens=MAX_TOKENS)
    assert r.choices[0].message.content == ar["frames"]
    item = ITEMS[1]
    for url in (str(WORLD / item["video"]), (WORLD / item["video"]).as_uri()):
        r = client.chat.completions.create(model="world_qwen2_5_vl", max_tokens=MAX_TOKENS, messages=_messages(
            item["prompt"], {"type": "video_url", "video_url": {"url": url}}))
        assert r.choices[0].message.content == ar[item["id"]]


def test_sampled_at_a_seed_equals_ar_at_that_seed(client, ar):
    """Position-keyed sampling: a seeded output is ar's own sample at that seed, whatever drafted it."""
    item = ITEMS[1]
    for seed in (1, 2):
        assert _ask(client, item, seed=seed, **SAMPLED).choices[0].message.content == ar[f"sampled{seed}"]
    text, _, _ = _streamed(client, _messages(item["prompt"], _video_part(item)), max_tokens=MAX_TOKENS, seed=2,
                           **SAMPLED)
    assert text == ar["sampled2"]


def test_lmms_eval_s_video_url_with_media_io_kwargs_equals_ar(client, ar):
    """lmms-eval's openai backend with pass_video_url sends a file:// URL and vLLM's media_io_kwargs (its frame
    count): the item's own sampling, as a manifest line's num_frames (8 is the config's: ar's answer)."""
    item = ITEMS[0]
    url = (WORLD / item["video"]).as_uri()
    r = client.chat.completions.create(model="world_qwen2_5_vl", max_tokens=MAX_TOKENS, messages=_messages(
        item["prompt"], {"type": "video_url", "video_url": {"url": url}}),
        extra_body={"media_io_kwargs": {"video": {"num_frames": 8}}})
    assert r.choices[0].message.content == ar[item["id"]]
    status, body = _status(client, messages=_messages(item["prompt"], _video_part(item)),
                           extra_body={"media_io_kwargs": {"video": {"num_frames": 0}}})
    assert status == 400 and "num_frames" in body["message"]


def test_stop_strings_cut_plain_and_streamed_text_alike(client, ar):
    item = ITEMS[0]
    assert _ask(client, item, stop=["square"]).choices[0].message.content == ar["stopped"]
    text, _, _ = _streamed(client, _messages(item["prompt"], _video_part(item)), max_tokens=MAX_TOKENS, stop="square")
    assert text == ar["stopped"]


def _burst(client, count: int, threads: int, ar: dict) -> list:
    """`count` requests, the items in turn, from `threads` clients at once: each answered once, with `ar`'s text.
    Returns the responses."""
    with ThreadPoolExecutor(threads) as pool:
        answers = list(pool.map(lambda item: (item["id"], _ask(client, item)), [ITEMS[n % 2] for n in range(count)]))
    assert len({r.id for _, r in answers}) == count
    assert [r.choices[0].message.content for _, r in answers] == [ar[i] for i, _ in answers]
    return [r for _, r in answers]


def _streams_as_ar(client, ar: dict) -> None:
    """A streamed answer is `ar`'s text, in pieces as rounds commit."""
    text, chunks, _ = _streamed(client, _messages(ITEMS[0]["prompt"], _video_part(ITEMS[0])), max_tokens=MAX_TOKENS)
    assert text == ar[ITEMS[0]["id"]]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3


def test_a_burst_from_four_threads_is_answered_once_each_as_ar_answers(client, ar):
    answers = _burst(client, 8, 4, ar)
    assert max(r.usage.vpsd["batch_size"] for r in answers) > 1  # they were decoded together


def test_the_engine_stops_a_request_whose_client_left_and_serves_the_next(ar_llm, ar, monkeypatch):
    """In process (serve/online.py), over the API's own `ar` LLM: a streamed request abandoned at its first text
    leaves the engine at its next round with the error that says so; the next request, at another temperature
    (another engine), is still ar's own, and so is the one after, on an engine renewed after one request."""
    from vpsd.serve import online
    from vpsd.serve.jobs import Job, JobQueue
    from vpsd.serve.online import OnlineEngine

    monkeypatch.setattr(online, "RENEW_AFTER_REQUESTS", 1)
    queue = JobQueue(max_queue=4, batch=2)
    engine = OnlineEngine(ar_llm, queue)
    item = ITEMS[1]
    video = str(WORLD / item["video"])
    try:
        seen: list[str] = []
        left = Job(vpsd.VideoRequest(video, item["prompt"], id="left"), vpsd.SamplingParams(max_new_tokens=MAX_TOKENS))
        left.on_text = lambda text: (seen.append(text), left.abandon())
        queue.submit(left)
        out = left.future.result(timeout=60).output
        assert out.finish_reason == "error" and "cancelled" in out.error and len(seen) == 1
        nxt = queue.submit(Job(vpsd.VideoRequest(video, item["prompt"], id="next"),
                               vpsd.SamplingParams(max_new_tokens=MAX_TOKENS, seed=2, **SAMPLED)))
        assert nxt.future.result(timeout=60).output.text == ar["sampled2"]
        again = queue.submit(Job(vpsd.VideoRequest(video, item["prompt"], id="again"),
                                 vpsd.SamplingParams(max_new_tokens=MAX_TOKENS, seed=1, **SAMPLED)))
        assert again.future.result(timeout=60).output.text == ar["sampled1"]
    finally:
        assert engine.close(30)


def test_metrics_count_a_second_question_about_a_video_as_a_prefix_hit(ar_llm, tmp_path):
    """In process: the target's prefix cache (engine/prefix_cache.py) on /metrics; two questions about one video
    (frames no other test sends) -> one more miss, then one more hit; bytes held."""
    import asyncio

    from vpsd.serve.app import ServeSettings, create_app
    from vpsd.serve.jobs import Job, JobQueue
    from vpsd.serve.metrics import Metrics
    from vpsd.serve.online import OnlineEngine

    def counts() -> dict[str, float]:
        text = asyncio.run(service.prometheus()).body.decode()
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith("vpsd_prefix_reuse_")}

    metrics = Metrics("world_qwen2_5_vl")
    queue = JobQueue(max_queue=4, batch=1, observer=metrics)
    engine = OnlineEngine(ar_llm, queue)
    app = create_app(ar_llm, engine, ServeSettings("world_qwen2_5_vl", "ar", scratch=tmp_path), metrics)
    service = app.state.service
    frames = _frames()[:, ::-1].copy()  # mirrored: a video no other test sends
    seen = []
    try:
        for k, question in enumerate(["What moves?", "What color is the square?"]):
            job = queue.submit(Job(vpsd.VideoRequest(frames, question, id=f"q{k}"),
                                   vpsd.SamplingParams(max_new_tokens=4)))
            assert job.future.result(timeout=60).output.finish_reason != "error"
            seen.append(counts())
    finally:
        assert engine.close(30)
    first, second = seen  # the cache is the model's: earlier tests' counts are in both
    assert first["vpsd_prefix_reuse_misses_total"] >= 1
    assert second["vpsd_prefix_reuse_hits_total"] - first["vpsd_prefix_reuse_hits_total"] == 1
    assert second["vpsd_prefix_reuse_misses_total"] == first["vpsd_prefix_reuse_misses_total"]
    assert second["vpsd_prefix_reuse_bytes"] > 0


def _status(client, **kw) -> tuple[int, dict]:
    try:
        client.chat.completions.create(model=kw.pop("model", "world_qwen2_5_vl"), **kw)
    except openai.APIStatusError as e:
        return e.status_code, e.body
    return 200, {}


def test_refusals_are_openai_errors_and_the_server_goes_on(server, client, ar):
    item = ITEMS[0]
    video = _video_part(item)
    msgs = _messages(item["prompt"], video)
    wrong_key = openai.OpenAI(base_url=f"{server.base}/v1", api_key="nope", max_retries=0)
    assert _status(wrong_key, messages=msgs)[0] == 401
    assert _get(f"{server.base}/v1/models", key=None)[0] == 401
    status, body = _status(client, messages=msgs, n=2, logprobs=True)
    assert status == 400 and "n=2" in body["message"] and "logprobs=True" in body["message"]
    status, body = _status(client, messages=msgs, top_p=1.5)
    assert status == 400 and "top_p" in body["message"]
    assert _status(client, messages=msgs, model="gpt-4o")[0] == 404
    missing = {"type": "video_url", "video_url": {"url": str(WORLD / "videos" / "no-such.mp4")}}
    status, body = _status(client, messages=_messages("x", missing), max_tokens=4)
    assert status == 400 and body["code"] == "missing" and "no-such.mp4" in body["message"]
    outside = {"type": "video_url", "video_url": {"url": str(ROOT / "README.md")}}
    assert _status(client, messages=_messages("x", outside))[0] == 403
    bad = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,@@@"}}
    assert _status(client, messages=_messages("x", bad))[0] == 400
    corrupt = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(b"x" * 999).decode()}}
    status, body = _status(client, messages=_messages("x", corrupt), max_tokens=4)
    assert status == 400 and body["code"] == "corrupt"
    big = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + "A" * (1536 * 1024)}}  # 1.1 MiB
    status, body = _status(client, messages=_messages("x", big))
    assert status == 413 and body["code"] == "video_too_large"
    huge = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + "A" * (3 * 2**20)}}
    assert _status(client, messages=_messages("x", huge))[0] == 413
    assert _status(client, messages=[*msgs, {"role": "assistant", "content": "x"}])[0] == 400  # answers a user turn
    assert _status(client, messages=_messages("no video"))[0] == 400
    assert _ask(client, item).choices[0].message.content == ar[item["id"]]  # still up, still right


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["world_qwen2_5_vl"]
    status, body = _get(f"{server.base}/health", key=None)
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, body = _get(f"{server.base}/metrics", key=None)
    text = body.decode()
    assert status == 200
    for name in ("vpsd_requests_total", "vpsd_generation_tokens_total", "vpsd_mean_accepted_tokens_bucket",
                 "vpsd_time_to_first_token_seconds_bucket", "vpsd_decode_step_seconds_bucket", "vpsd_queue_depth"):
        assert name in text, name
    assert 'vpsd_requests_total{status="401"}' in text and 'vpsd_requests_total{status="413"}' in text


def test_sigterm_finishes_the_request_in_flight_and_exits_0(server, client, ar):
    """Last in the file: it ends the module's server."""
    item = ITEMS[1]
    answer: dict = {}
    asking = threading.Thread(target=lambda: answer.update(r=_ask(client, item)))
    asking.start()
    deadline = time.monotonic() + 30
    while json.loads(_get(f"{server.base}/health")[1]).get("running", 0) + json.loads(
            _get(f"{server.base}/health")[1]).get("queue", 0) == 0 and "r" not in answer:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    server.send_signal(signal.SIGTERM)
    asking.join(60)
    assert answer["r"].choices[0].message.content == ar[item["id"]]
    assert server.wait(60) == 0, server.log.read_text()
    with pytest.raises(OSError):
        _get(f"{server.base}/health")
