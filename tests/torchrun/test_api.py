"""vpsd from Python (vpsd/api.py): the job's path below the I/O.

Every method's outputs through the API equal `ar`'s (ar, sd, pearl, hippo at B = 1 and 2; the parallel ones with
their roles as child ranks, the default, and on threads), and `ar`'s equal plain autoregressive decoding (the
torchrun job is held to the same `ar` by test_pipeline_torchrun). Bad input fails only its own request, with the job's error; bad
settings are a ConfigError before any model loads; a sampled call is reproducible from its seed, and the same
through ranks and threads; stop strings cut the text; the child ranks stop on close(), on an interrupt and when
one of them dies (RanksFailed, then started again), leaving no process or thread behind."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import vpsd
from tests.torchrun_jobs import ROOT, world_manifest
from vpsd.launch.manifest import load_manifest

CONFIG = ROOT / "configs" / "tiny_qwen2_5_vl.yaml"


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return world_manifest(str(tmp_path_factory.getbasetemp()), count=3)


@pytest.fixture(scope="module")
def items(manifest) -> list[vpsd.VideoRequest]:
    return [vpsd.VideoRequest(str(it.video), it.prompt, id=it.id) for it in load_manifest(manifest)[0]]


@pytest.fixture(scope="module")
def ar_outputs(items) -> dict[str, vpsd.Output]:
    with vpsd.LLM(CONFIG, method="ar") as llm:
        return {o.id: o for o in llm.generate(items, vpsd.SamplingParams(max_new_tokens=24))}


@pytest.fixture(scope="module")
def ar(ar_outputs) -> dict[str, list[int]]:
    return {k: o.token_ids for k, o in ar_outputs.items()}


def test_ar_through_the_api_is_plain_autoregressive_decoding(manifest, ar):
    from tests.torchrun_jobs import ar_reference

    assert ar == ar_reference("qwen2_5_vl", manifest)


# hippo on its child ranks against ar, with the tiny config's own draft: --slow (in CI the example script runs it on
# the world pair, and test_child_ranks_stop... holds the ranks, drafting for themselves, to ar).
@pytest.mark.parametrize("method,batch,draft_on", [("sd", 1, None), ("sd", 2, None), ("pearl", 1, "thread"),
                                                   ("pearl", 2, None),
                                                   pytest.param("hippo", 1, "rank", marks=pytest.mark.slow),
                                                   ("hippo", 1, "thread"), ("hippo", 2, None), ("sd-tree", 2, None),
                                                   ("std", 2, None)])
def test_every_method_equals_ar_at_batch_1_and_2(items, ar, method, batch, draft_on):
    with vpsd.LLM(CONFIG, method=method, batch=batch, gamma=3, draft_on=draft_on, settings={"draft": "self"}) as llm:
        assert llm.served == (draft_on == "rank")  # at B = 2 these draft in the target's process
        outs = llm.generate(items, vpsd.SamplingParams(max_new_tokens=24))
    assert {o.id: o.token_ids for o in outs} == ar
    assert all(o.error is None and o.stats["rounds"] >= 1 for o in outs)
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    if method != "sd" or batch == 1:
        assert sum(o.stats["accepted_tokens"] for o in outs) > 0  # it drafted (the target drafting for itself)


def test_a_videos_questions_in_one_call_share_one_packed_prefill_and_equal_ar(items, monkeypatch):
    """vpsd.LLM says which requests share a video (JobEvents.group_key): at B > 1 a run of them is prefilled in one
    packed forward (engine/sibling_prefill.py; lmms-eval's backend sends a video's questions in a row), and every
    output equals `ar`'s at batch 1."""
    from vpsd.engine import sibling_prefill

    packed = []
    real = sibling_prefill.prefill_siblings_with_signals
    monkeypatch.setattr(sibling_prefill, "prefill_siblings_with_signals",
                        lambda target, embs, *a: packed.append(len(embs)) or real(target, embs, *a))
    asks = [vpsd.VideoRequest(items[0].video, q, id=f"q{i}")
            for i, q in enumerate(["Describe the video.", "What moves to the left?", "What color is the ball?"])]
    params = vpsd.SamplingParams(max_new_tokens=16)
    with vpsd.LLM(CONFIG, method="ar") as llm:
        want = {o.id: o.token_ids for o in llm.generate(asks, params)}
    assert packed == []  # batch 1: each prefilled at its admission
    with vpsd.LLM(CONFIG, method="hippo", batch=3, gamma=3, settings={"draft": "self"}) as llm:
        got = {o.id: o.token_ids for o in llm.generate(asks, params)}
    assert got == want and packed == [3]


BAD = [vpsd.VideoRequest("/no/such/video.mp4", "Describe the video.", id="missing"),
       vpsd.VideoRequest(np.zeros((4, 56, 56), np.uint8), "Describe the video.", id="not-frames"),
       vpsd.VideoRequest(ROOT / "README.md", [{"role": "system", "content": "x"}], id="no-user-turn")]
# Malformed requests: each was a TypeError for the whole call (the good requests beside it got nothing), or
# decoded where a job refuses the item (an empty prompt), or an error without a kind.
MALFORMED = {"prompt-none": vpsd.VideoRequest("/v.mp4", None, id="prompt-none"),
             "prompt-int": vpsd.VideoRequest("/v.mp4", 7, id="prompt-int"),
             "video-none": vpsd.VideoRequest(None, "Describe the video.", id="video-none"),
             "video-int": vpsd.VideoRequest(3, "Describe the video.", id="video-int"),
             "prompt-empty": vpsd.VideoRequest("/v.mp4", "  ", id="prompt-empty"),
             "no-user-turn": BAD[2],
             "messages-not-dicts": vpsd.VideoRequest("/v.mp4", ["user", "hi"], id="messages-not-dicts"),
             "seed-negative": vpsd.VideoRequest("/v.mp4", "Describe the video.", id="seed-negative", seed=-1)}


def check_bad(outs: dict[str, vpsd.Output]) -> None:
    assert outs["missing"].finish_reason == "error" and outs["missing"].error_kind == "missing"
    assert outs["missing"].error == "VideoError: missing video /no/such/video.mp4: no such file or directory"
    assert outs["not-frames"].error_kind == "bad_request" and "(T, H, W, 3) uint8" in outs["not-frames"].error
    assert "needs a user turn" in outs["no-user-turn"].error and outs["no-user-turn"].error_kind == "bad_request"


def test_a_bad_request_fails_alone_with_the_jobs_error(items, ar):
    with vpsd.LLM(CONFIG, method="hippo", draft_on="thread") as llm:
        outs = {o.id: o for o in llm.generate([items[0], *BAD, MALFORMED["prompt-none"], MALFORMED["video-none"],
                                               items[1]], vpsd.SamplingParams(max_new_tokens=24))}
    assert outs[items[0].id].token_ids == ar[items[0].id] and outs[items[1].id].token_ids == ar[items[1].id]
    check_bad(outs)
    assert outs["prompt-none"].error_kind == outs["video-none"].error_kind == "bad_request"


def test_a_malformed_request_is_its_own_bad_request_output():
    with vpsd.LLM(CONFIG, method="ar") as llm:  # nothing to decode: no model runs
        outs = llm.generate(list(MALFORMED.values()) + ["clip.mp4"], vpsd.SamplingParams(max_new_tokens=4))
    assert [o.id for o in outs] == [*MALFORMED, outs[-1].id] and outs[-1].id.startswith("request-")
    assert all(o.finish_reason == "error" and o.error_kind == "bad_request" and o.token_ids == [] for o in outs)
    said = {o.id: o.error for o in outs}
    assert said["prompt-none"] == ("bad request: prompt must be a string or chat messages (a list of {'role': ..., "
                                   "'content': ...} dicts), got None")
    assert said["prompt-int"].endswith("got int 7")
    assert said["video-none"] == ("bad request: video must be a path (str or Path) or a (T, H, W, 3) uint8 array, "
                                  "got None")
    assert said["prompt-empty"] == "bad request: prompt is empty (a job refuses such an item too: vpsd check)"
    assert "needs a user turn" in said["no-user-turn"] and "seed must be an int >= 0" in said["seed-negative"]
    assert said[outs[-1].id] == "bad request: a request must be a vpsd.VideoRequest, got str 'clip.mp4'"


def test_bad_settings_are_a_config_error_before_any_model_loads():
    with pytest.raises(vpsd.ConfigError, match="no such config file: no/such/config.yaml"):
        vpsd.LLM("no/such/config.yaml", method="ar")
    with pytest.raises(vpsd.ConfigError, match="unknown method 'hipo'"):
        vpsd.LLM(CONFIG, method="hipo")
    with pytest.raises(vpsd.ConfigError, match=r"unknown key decoding\.gama \(did you mean 'gamma'\?\)"):
        vpsd.LLM(CONFIG, method="ar", settings={"decoding.gama": 3})
    with pytest.raises(vpsd.ConfigError, match="method tabed: it drafts with TABED's views"):
        vpsd.LLM(CONFIG, method="tabed", batch=2)
    with vpsd.LLM(CONFIG, method="ar") as llm:
        with pytest.raises(vpsd.ConfigError, match=r"top_p must be in \(0, 1\]"):
            llm.generate([], vpsd.SamplingParams(top_p=0.0))
        with pytest.raises(vpsd.ConfigError, match="stop must be non-empty strings"):
            llm.generate([], vpsd.SamplingParams(stop=["\n", ""]))
    assert vpsd.SamplingParams(stop="\n\n").stop == ("\n\n",)  # one string is one stop string, not its characters


def test_arrays_chat_messages_seeds_and_stop_strings():
    frames = np.random.default_rng(0).integers(0, 256, (4, 56, 56, 3), dtype=np.uint8)
    chat = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Describe the video."}]}]
    with vpsd.LLM(CONFIG, method="pearl", draft_on="thread", settings={"draft": "self"}) as llm:
        sampled = vpsd.SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
        first = llm.generate(vpsd.VideoRequest(frames, chat), sampled)[0]
        again = llm.generate(vpsd.VideoRequest(frames, "Describe the video."), sampled)[0]
        other = llm.generate(vpsd.VideoRequest(frames, "Describe the video."),
                             vpsd.SamplingParams(max_new_tokens=12, temperature=1.0, seed=8))[0]
        assert first.error is None and first.token_ids == again.token_ids != other.token_ids
        mine = llm.generate(vpsd.VideoRequest(frames, "Describe the video.", seed=8), sampled)[0]  # its own seed
        assert mine.token_ids == other.token_ids
        greedy = llm.generate(vpsd.VideoRequest(frames, "Describe the video."), vpsd.SamplingParams(max_new_tokens=12))[0]
        stop = greedy.text[len(greedy.text) // 2:][:3]
        cut = llm.generate(vpsd.VideoRequest(frames, "Describe the video."),
                           vpsd.SamplingParams(max_new_tokens=12, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == greedy.text[:greedy.text.find(stop)]
    assert cut.token_ids == greedy.token_ids[:len(cut.token_ids)] and len(cut.token_ids) <= len(greedy.token_ids)
    with vpsd.LLM(CONFIG, method="ar") as llm:  # a seeded sample is `ar`'s own (position-keyed sampling)
        assert llm.generate(vpsd.VideoRequest(frames, "Describe the video."), sampled)[0].token_ids == first.token_ids


def _gone_within(seconds: float) -> bool:
    """Whether this process's ranks have all exited within `seconds`."""
    deadline = time.monotonic() + seconds
    while _children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _children()


def _children() -> set[int]:
    """The vpsd ranks this process started and that still run (zombies, reaped or not, are gone)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
                cmd = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            if int(stat[1]) == os.getpid() and stat[0] != "Z" and b"vpsd.launch.entry" in cmd:
                found.add(int(entry))
    return found


def test_nothing_is_left_running_after_close(items):
    before = _threads()
    llm = vpsd.LLM(CONFIG, method="hippo", draft_on="thread")
    llm.generate(items[:1])
    llm.close()
    assert _threads() <= before, _threads()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(items[:1])


def test_child_ranks_stop_on_close_an_interrupt_and_a_death_and_sample_as_threads(items, ar_outputs):
    """Started, killed (RanksFailed), started again and interrupted, started once more: then the ranks decode as
    `ar` does, fail bad requests alone, and sample as the roles on threads do."""
    frames = np.random.default_rng(1).integers(0, 256, (4, 56, 56, 3), dtype=np.uint8)
    sampled = vpsd.SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    with vpsd.LLM(CONFIG, method="hippo", gamma=3, draft_on="thread", settings={"draft": "self"}) as llm:
        on_threads = llm.generate(vpsd.VideoRequest(frames, "Describe the video."), sampled)[0]
    before = _threads()
    llm = vpsd.LLM(CONFIG, method="hippo", gamma=3, settings={"draft": "self"})
    assert len(_children()) == 3  # target, draft, pruner
    llm._ranks.children[1][1].kill()  # rank 1: the draft
    with pytest.raises(vpsd.RanksFailed, match=r"the draft rank \(rank 1\) exited"):
        llm.generate(items[:1])
    assert not _children()
    # The next call starts them again; a Ctrl-C in the middle of it stops them. Python's own SIGINT handler, as in
    # a caller's program: another test in this process may have run a job's entry in it, which installs its own.
    default = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            while True:  # starts the ranks (seconds), then decodes until the interrupt lands
                llm.generate(items, vpsd.SamplingParams(max_new_tokens=24))
        timer.join()
    finally:
        signal.signal(signal.SIGINT, default)
    assert _gone_within(10)  # the interrupt may land while they start: each is stopped, and exits within seconds
    # Once more, whole: ar's tokens and text, bad requests failed alone, among the good ones ...
    outs = {o.id: o for o in llm.generate([items[0], *BAD, *items[1:]], vpsd.SamplingParams(max_new_tokens=24))}
    assert {o.id: (o.token_ids, o.text) for o in outs.values() if o.id in ar_outputs} == \
        {k: (o.token_ids, o.text) for k, o in ar_outputs.items()}
    check_bad(outs)
    # ... a stop string ends the item on the target's rank, its output `ar`'s cut there (a job's item field) ...
    whole = ar_outputs[items[0].id]
    stop = whole.text[len(whole.text) // 3:][:2]
    cut = llm.generate(items[0], vpsd.SamplingParams(max_new_tokens=24, stop=(stop,)))[0]
    assert (cut.finish_reason, cut.text) == ("stop", whole.text[:whole.text.find(stop)])
    assert cut.token_ids == whole.token_ids[:len(cut.token_ids)] and cut.num_generated_tokens < len(whole.token_ids)
    # ... and frames in memory, sampled, drawn as on threads (one seed rule wherever the draft runs).
    on_ranks = llm.generate(vpsd.VideoRequest(frames, "Describe the video."), sampled)[0]
    assert on_ranks.error is None and on_ranks.token_ids == on_threads.token_ids
    assert on_ranks.stats["num_kept"] == on_threads.stats["num_kept"]
    # Another seed travels with the item: the same ranks sample it, `ar`'s own sample at that seed.
    ranks = llm._ranks
    reseeded = llm.generate(vpsd.VideoRequest(frames, "Describe the video."), dataclasses.replace(sampled, seed=6))[0]
    assert llm._ranks is ranks and reseeded.token_ids != on_ranks.token_ids
    with vpsd.LLM(CONFIG, method="ar") as ar_llm:
        assert [o.token_ids for o in ar_llm.generate([vpsd.VideoRequest(frames, "Describe the video.", seed=s)
                                                      for s in (5, 6)], sampled)] == \
            [on_ranks.token_ids, reseeded.token_ids]
    llm.close()
    assert not _children() and _threads() <= before, _threads()


def _drain(llm: vpsd.LLM, wanted: set[str], reports: dict[str, list[list[int]]], limit_s: float = 120):
    """Outputs of `wanted`, by id, with each request's progress reports (LLM.progress) collected meanwhile."""
    outs, end = {}, time.monotonic() + limit_s
    while not wanted <= outs.keys():
        assert time.monotonic() < end, f"no result for {wanted - outs.keys()} within {limit_s} s"
        got = llm.results(1.0)
        for rid, tokens in llm.progress().items():
            reports.setdefault(rid, []).append(tokens)
        outs.update({o.id: o for o in got})
    return outs


def test_requests_on_child_ranks_report_each_rounds_tokens_and_a_cancelled_one_frees_the_ranks(items, ar):
    """What `vpsd serve` streams and cancels on ranks with (serve/on_ranks.py): every round's committed tokens
    come back while the request decodes, each report a longer prefix of its final tokens (`ar`'s); a request
    cancelled while it decodes ends at the target's next round as an error, far short of its budget, one
    cancelled before it started never runs, and the ranks then decode the next request as `ar` does."""
    params = vpsd.SamplingParams(max_new_tokens=24)
    hot = vpsd.SamplingParams(max_new_tokens=400, temperature=2.0, seed=3)  # long: EOS is rarely drawn this hot
    with vpsd.LLM(CONFIG, method="pearl", gamma=2, settings={"draft": "self"}) as llm:
        assert llm.served
        # Taken by `results` alone (a caller that never asks for progress): the reports left untaken must not end
        # its waits before it has read anything (they did: it spun, and the ranks waited for their answer).
        lone, end, got = llm.submit(items[1], params), time.monotonic() + 60, []
        while not got:
            assert time.monotonic() < end, "results() never returned the request"
            got = llm.results(1.0)
        assert got[0].id == lone and got[0].token_ids == ar[items[1].id]
        reports: dict[str, list[list[int]]] = {}
        rid = llm.submit(items[0], params)
        out = _drain(llm, {rid}, reports)[rid]
        assert out.token_ids == ar[items[0].id]
        seen = reports[rid]
        assert len(seen) >= 3, seen  # round by round, not once at the end
        assert all(len(a) < len(b) for a, b in zip(seen, seen[1:]))
        assert all(out.token_ids[:len(s)] == s for s in seen)
        # One decodes (the ranks' batch holds one), one waits behind it: both cancelled.
        long = llm.submit(vpsd.VideoRequest(items[1].video, items[1].prompt, id="long"), hot)
        queued = llm.submit(vpsd.VideoRequest(items[2].video, items[2].prompt, id="queued"), hot)
        llm.cancel(queued)
        gone = {o.id: o for o in llm.results(0.0)}  # never granted: answered here at once
        assert set(gone) == {queued}
        while not llm.progress().get(long):
            assert not llm.results(1.0)
        llm.cancel(long)
        after: dict[str, list[list[int]]] = {}
        gone.update(_drain(llm, {long}, after))
        assert all(len(tokens) < hot.max_new_tokens for tokens in after.get(long, []))  # it stopped short
        for o in gone.values():
            assert o.finish_reason == "error" and "cancelled" in o.error, o
        assert llm.in_flight == 0
        again = llm.submit(items[2], params)
        assert _drain(llm, {again}, {})[again].token_ids == ar[items[2].id]


VPSD_THREADS = ("vpsd-", "prefill", "reader", "draft_reader", "frames")  # the names vpsd gives its threads


def _threads() -> set[str]:
    """This process's threads that vpsd started (by the names it gives them): in a full suite the worker also holds
    other libraries' process-wide threads (tqdm's monitor, kept while any test's bar lives; an unnamed Thread-N),
    started and kept by nothing of the LLM's."""
    return {f"{t.name}:{t.ident}" for t in threading.enumerate() if t.name.startswith(VPSD_THREADS)}


def test_the_example_script_runs_from_the_repository_root():
    proc = subprocess.run([sys.executable, "examples/python_api.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("MAT") == 3
