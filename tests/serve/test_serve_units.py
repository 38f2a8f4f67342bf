"""The server's parts without a model: a streamed text never passes a stop string's cut and joins to the final
text; the queue refuses when full (429 with Retry-After), drops a request whose client left, and fails the queued
ones at shutdown (503); a request that arrives while another is in flight on child ranks is submitted at once
and answered as soon as it finishes, before the earlier one. The HTTP cases run the real app (FastAPI on uvicorn,
127.0.0.1) in a thread, with the child ranks' runner (serve/on_ranks.py) over a stand-in for the `LLM`'s
submit / results that holds each request until its gate opens, so that the queue's states are held while the
test looks at them (the model's outputs are test_serve.py's and test_serve_ranks.py's business)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from vpsd.api import Output, SamplingParams, VideoRequest
from vpsd.engine.request import CANCELLED
from vpsd.serve.jobs import Job, JobQueue, QueueFull, ServerClosing
from vpsd.serve.stream_text import TextStream

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

VOCAB = ["a", " b", "c", "\n", "\n\n", "x", "y", "\ufffd"]


def decode(tokens) -> str:
    return "".join(VOCAB[t] for t in tokens)


def stream_all(tokens: list[int], stop: tuple[str, ...], step: int = 1) -> tuple[list[str], str]:
    s = TextStream(decode, stop)
    pieces = [s.update(tokens[:n]) for n in range(step, len(tokens) + 1, step)]
    return pieces, s


@pytest.mark.parametrize("step", [1, 3])  # one token a round, or a parallel round's several at once
def test_streamed_text_stops_at_the_cut_and_joins_to_the_final_text(step):
    tokens = [0, 1, 3, 2, 4, 5, 0]  # "a b\nc\n\nxa"
    pieces, s = stream_all(tokens, ("\n\n",), step)
    assert "".join(pieces) == "a b\nc" and not any("\n\n" in p for p in pieces)
    assert s.update(tokens + [6]) == ""  # nothing after the stop, ever
    assert s.finish("a b\nc") == ""
    pieces, s = stream_all([0, 3], ("\n\n",))
    assert pieces == ["a", ""]  # a lone "\n" may start the stop string: held back
    assert s.finish("a\n") == "\n"  # released at the end: the output did not stop there
    pieces, s = stream_all([0, 7], ())
    assert pieces == ["a", ""]  # a replacement character: bytes the next token may complete


def test_the_queue_refuses_when_full_drops_a_left_client_and_fails_the_queued_at_close():
    q = JobQueue(max_queue=2, batch=1)
    jobs = [q.submit(Job(VideoRequest(f"v{n}", "p", id=str(n)), SamplingParams())) for n in range(2)]
    with pytest.raises(QueueFull) as full:
        q.submit(Job(VideoRequest("v", "p"), SamplingParams()))
    assert full.value.retry_after_s >= 1
    jobs[0].abandon()
    assert q.head() is jobs[1] and q.depth == 1
    q.close()
    with pytest.raises(ServerClosing):
        jobs[1].future.result(timeout=1)
    with pytest.raises(ServerClosing):
        q.submit(Job(VideoRequest("v", "p"), SamplingParams()))


class _Words:
    def encode(self, text: str, **_) -> list[int]:
        return list(range(len(text.split())))


class GatedRanks:
    """A stand-in for an `LLM` on child ranks (joins / submit / results): a submitted request is answered with its
    prompt once its own gate opens (`release`) or the common one (`gate`)."""

    tokenizer = _Words()
    pipelines = 1

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.released: set[str] = set()
        self.seen: list[str] = []  # prompts submitted, in order
        self.calls = 0  # submits
        self.most_in_flight = 0
        self.in_flight: dict[str, VideoRequest] = {}
        self.cancelled: list[str] = []  # request ids the runner cancelled
        self.committing: set[str] = set()  # prompts whose requests report a token at each look (progress)
        self.committed: dict[str, int] = {}
        self.reuse: dict[str, int] | None = None  # the targets' prefix-cache counters, as their results carried them

    def reuse_stats(self) -> dict[str, int] | None:
        return self.reuse

    def joins(self, params) -> bool:
        return True

    def submit(self, request, params) -> str:
        self.calls += 1
        self.seen.append(request.prompt)
        self.in_flight[request.id] = request
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        return request.id

    def progress(self) -> dict[str, list[int]]:
        """A request whose prompt is in `committing` commits one more token at each look; the others none."""
        grown = {}
        for r in self.in_flight.values():
            if r.prompt in self.committing and r.id not in self.cancelled:
                self.committed[r.id] = self.committed.get(r.id, 0) + 1
                grown[r.id] = list(range(self.committed[r.id]))
        return grown

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def text(self, token_ids) -> str:
        return " ".join(f"w{t}" for t in token_ids)

    def results(self, timeout_s: float) -> list[Output]:
        end = time.monotonic() + timeout_s
        while not (done := [r for r in self.in_flight.values() if self.gate.is_set() or r.prompt in self.released
                            or r.id in self.cancelled]):
            if time.monotonic() >= end:
                return []
            time.sleep(0.005)
        for r in done:
            del self.in_flight[r.id]
        return [Output(r.id, "", [], "error", error=f"ValueError: {CANCELLED}") if r.id in self.cancelled else
                Output(r.id, f"answer to {r.prompt}", [1, 2], "stop", 4, 2,
                       {"mean_accepted_tokens": 2.0, "rounds": 1, "decode_s": 0.01}) for r in done]


@pytest.fixture()
def gated_server(tmp_path):
    yield from _gated_server(tmp_path, batch=1)


@pytest.fixture()
def gated_server_of_two(tmp_path):
    yield from _gated_server(tmp_path, batch=2)


def _gated_server(tmp_path, batch: int):
    from vpsd.serve.app import ServeSettings, create_app
    from vpsd.serve.media import MediaLimits
    from vpsd.serve.metrics import Metrics
    from vpsd.serve.on_ranks import RanksRunner

    llm = GatedRanks()
    metrics = Metrics("m")
    queue = JobQueue(max_queue=2, batch=batch, observer=metrics)
    runner = RanksRunner(llm, queue)
    videos = tmp_path / "videos"
    videos.mkdir()
    (videos / "clip.mp4").write_bytes(b"not decoded by the stand-in")
    app = create_app(llm, runner, ServeSettings("m", "ar", limits=MediaLimits(allowed_media_dir=videos),
                                                scratch=tmp_path), metrics)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield llm, queue, f"http://127.0.0.1:{port}/v1", videos / "clip.mp4"
    llm.gate.set()
    server.should_exit = True
    thread.join(10)
    runner.close(5)


def _ask(base: str, clip: Path, prompt: str, timeout: float = 30):
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=timeout)
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": [
        {"type": "text", "text": prompt}, {"type": "video_url", "video_url": {"url": str(clip)}}]}])


def _until(condition, limit_s: float = 10) -> None:
    end = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < end
        time.sleep(0.01)


def test_a_full_queue_answers_429_and_a_client_that_leaves_is_dropped(gated_server):
    llm, queue, base, clip = gated_server
    answers: dict[str, object] = {}

    def ask(prompt: str) -> None:
        answers[prompt] = _ask(base, clip, prompt)

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    _until(lambda: llm.calls == 1)  # the ranks hold "first" at the gate
    ahead = threading.Thread(target=ask, args=("ahead",))
    ahead.start()
    _until(lambda: llm.calls == 2)  # submitted too: the ranks read its video while "first" decodes
    with pytest.raises(openai.APITimeoutError):
        _ask(base, clip, "leaves", timeout=0.5)  # queued, then its client gives up
    _until(lambda: queue.depth == 0)  # dropped from the queue
    waiting = [threading.Thread(target=ask, args=(p,)) for p in ("second", "third")]
    for t in waiting:
        t.start()
    _until(lambda: queue.depth == 2)
    with pytest.raises(openai.RateLimitError) as refused:
        _ask(base, clip, "too many")
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert refused.value.body["code"] == "queue_full"
    llm.gate.set()
    for t in [first, ahead, *waiting]:
        t.join(30)
    assert {p: a.choices[0].message.content for p, a in answers.items()} == {
        p: f"answer to {p}" for p in ("first", "ahead", "second", "third")}
    assert sorted(llm.seen) == ["ahead", "first", "second", "third"]  # each decoded once; "leaves" never


def test_a_request_sent_while_another_decodes_on_the_ranks_joins_it_and_is_answered_first(gated_server_of_two):
    llm, queue, base, clip = gated_server_of_two
    answered: list[str] = []

    def ask(prompt: str) -> None:
        answered.append(_ask(base, clip, prompt).choices[0].message.content)

    long = threading.Thread(target=ask, args=("long",))
    long.start()
    _until(lambda: llm.calls == 1)
    short = threading.Thread(target=ask, args=("short",))
    short.start()
    _until(lambda: llm.calls == 2 and queue.running == 2)  # submitted while "long" is in flight, not after it
    assert llm.most_in_flight == 2
    llm.released.add("short")
    short.join(30)
    assert answered == ["answer to short"] and long.is_alive()
    llm.released.add("long")
    long.join(30)
    assert answered == ["answer to short", "answer to long"]


def test_the_ranks_tokens_stream_as_they_commit_and_a_client_that_leaves_is_cancelled_on_them(gated_server):
    """serve/on_ranks.py: each round's tokens the ranks report (LLM.progress) go out as text at once; a client that
    closes its stream has its request cancelled on the ranks (LLM.cancel), counted as stopped in the engine; the
    targets' prefix-cache counters their results carried (LLM.reuse_stats) are on /metrics."""
    import urllib.request

    llm, queue, base, clip = gated_server
    llm.committing.add("streamed")
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=30)
    stream = client.chat.completions.create(model="m", stream=True, messages=[{"role": "user", "content": [
        {"type": "text", "text": "streamed"}, {"type": "video_url", "video_url": {"url": str(clip)}}]}])
    pieces = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if len(pieces) == 3:
            break
    assert pieces == ["w0", " w1", " w2"]  # the gate is shut: these came as the tokens were reported
    stream.close()
    _until(lambda: llm.cancelled and queue.running == 0)
    metrics = urllib.request.urlopen(f"{base.removesuffix('/v1')}/metrics", timeout=10).read().decode()
    assert 'vpsd_requests_cancelled_total{where="engine"} 1.0' in metrics
    assert "vpsd_prefix_reuse" not in metrics  # no result has carried the ranks' counters yet
    llm.reuse = {"hits": 3, "misses": 2, "reused_tokens": 210, "evicted": 1, "bytes": 4096, "budget_bytes": 8192}
    metrics = urllib.request.urlopen(f"{base.removesuffix('/v1')}/metrics", timeout=10).read().decode()
    for line in ("vpsd_prefix_reuse_hits_total 3.0", "vpsd_prefix_reuse_misses_total 2.0",
                 "vpsd_prefix_reuse_reused_tokens_total 210.0", "vpsd_prefix_reuse_evictions_total 1.0",
                 "vpsd_prefix_reuse_bytes 4096.0", "vpsd_prefix_reuse_budget_bytes 8192.0"):
        assert line in metrics.splitlines(), line
    llm.released.add("next")
    assert _ask(base, clip, "next").choices[0].message.content == "answer to next"


def test_a_body_that_is_not_a_request_is_a_400_in_openai_s_shape(gated_server):
    import json
    import urllib.error
    import urllib.request

    _, _, base, _ = gated_server
    for body in (b"not json", b'{"messages": []}', b'{"messages": [{"role": "user", "content": 3}]}'):
        req = urllib.request.Request(f"{base}/chat/completions", data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 400
        error = json.loads(e.value.read())["error"]
        assert error["type"] == "invalid_request_error" and error["message"].startswith("invalid request")


def test_a_non_loopback_host_without_a_key_is_refused_before_any_model_loads(monkeypatch, capsys):
    from vpsd.serve.cli import _is_loopback, main

    monkeypatch.delenv("VPSD_API_KEY", raising=False)
    assert main(["--config", "no/such/config.yaml", "--host", "0.0.0.0"]) == 2
    assert "without an API key" in capsys.readouterr().err
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("localhost")
    assert not _is_loopback("0.0.0.0") and not _is_loopback("10.0.0.5") and not _is_loopback("example.org")
