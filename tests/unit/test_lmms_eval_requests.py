"""The lmms-eval backend's pure parts, without lmms-eval (tests/torchrun/test_lmms_eval_backend.py runs it for real).

- a task document's chat messages become one VideoRequest (its video, its user text, a system prompt with it) or
  a BadRequest naming what vpsd cannot take; one video's requests decode together, answered in lmms-eval's order;
- generation kwargs become SamplingParams, greedy unless sampling is on, with what would decode another
  distribution refused as a ConfigError for the whole group;
- the speed file: the job's sums over a task's rows, the comparison with an `ar` file of the same task when one
  lies in the same folder.
"""

from __future__ import annotations

import json

import pytest

from vpsd.config import ConfigError
from vpsd.integrations.lmms_eval.requests import BadRequest, group_key, sampling_params, video_request
from vpsd.integrations.lmms_eval.speed import SpeedLog, speed_file


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


VIDEO = {"type": "video", "url": "clip.mp4"}


def test_one_video_and_the_user_text_make_the_request():
    req = video_request(user(VIDEO, {"type": "text", "text": "Describe"}, {"type": "text", "text": "it."}), "t:0")
    assert (req.video, req.prompt, req.id) == ("clip.mp4", "Describe\nit.", "t:0")


@pytest.mark.parametrize(("messages", "says"), [
    (user({"type": "text", "text": "x"}), "holds 0"),
    (user(VIDEO, VIDEO), "holds 2"),
    (user(VIDEO, {"type": "image", "url": "a.png"}), "also holds image"),
    (user({"type": "video", "url": {"video": "clip.mp4", "video_start": 1.0}}), "video_start"),
    ([*user(VIDEO), {"role": "assistant", "content": "x"}], "one user turn"),
    ([*user(VIDEO), {"role": "system", "content": "late"}], "optional system message"),
    ([{"role": "system", "content": [{"type": "image", "url": "a.png"}]}, *user(VIDEO)], "text only"),
    ([{"role": "user", "content": "text only"}], "no video"),
])
def test_what_vpsd_cannot_take_is_a_bad_request(messages, says):
    with pytest.raises(BadRequest, match=says):
        video_request(messages, "t:0")


def test_a_system_message_makes_the_prompt_a_conversation():
    """A task's system prompt goes with the request (the chat template renders it); without one, the plain text."""
    from vpsd.models.prompt import Turn, turns_of

    text = {"type": "text", "text": "Describe it."}
    for content in ("Be brief.", [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]):
        req = video_request([{"role": "system", "content": content}, *user(VIDEO, text)], "t:0")
        assert req.video == "clip.mp4"
        assert turns_of(req.prompt) == [Turn("system", "Be brief." if isinstance(content, str) else "Be\nbrief."),
                                        Turn("user", "Describe it.", True)]
    assert video_request(user(VIDEO, text), "t:0").prompt == "Describe it."


def test_one_videos_requests_decode_together_and_answer_in_lmms_evals_order():
    """generate_by_video: each video's requests next to each other (videos by their first request, a video's
    requests in order), so the engine prefills a video once for all of them; the answers in the requests' order."""
    from vpsd.api import VideoRequest
    from vpsd.integrations.lmms_eval.requests import generate_by_video, video_order

    videos = ["a.mp4", "b.mp4", "a.mp4", "c.mp4", "b.mp4", "a.mp4"]
    requests = [VideoRequest(v, f"q{i}", id=str(i)) for i, v in enumerate(videos)]
    assert video_order(requests) == [0, 2, 5, 1, 4, 3]
    calls = []

    def generate(batch):
        calls.append([r.id for r in batch])
        return [f"answer {r.id} about {r.video}" for r in batch]

    answers = generate_by_video(generate, requests)
    assert calls == [["0", "2", "5", "1", "4", "3"]]  # one call, one video's requests adjacent
    assert answers == [f"answer {i} about {v}" for i, v in enumerate(videos)]
    assert generate_by_video(generate, []) == []


def test_generation_kwargs_as_sampling_params():
    greedy, ignored = sampling_params({"max_new_tokens": 16, "temperature": 0, "top_p": 0.5, "num_beams": 1,
                                       "do_sample": False, "until": ["\n\n"], "image_aspect_ratio": "pad"})
    assert (greedy.max_new_tokens, greedy.temperature, greedy.top_p, greedy.stop) == (16, 0.0, 1.0, ("\n\n",))
    assert ignored == []
    # transformers' rule: do_sample false is greedy whatever the temperature.
    assert sampling_params({"temperature": 0.7, "do_sample": False})[0].temperature == 0.0
    sampled, ignored = sampling_params({"temperature": 0.7, "until": "Q:", "seed_of_my_own": 1})
    assert (sampled.temperature, sampled.stop, sampled.max_new_tokens) == (0.7, ("Q:",), None)
    assert ignored == ["seed_of_my_own"]
    filtered = sampling_params({"temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.05})[0]
    assert (filtered.top_k, filtered.top_p, filtered.min_p) == (50, 0.9, 0.05)


def test_what_would_decode_another_distribution_is_refused():
    with pytest.raises(ConfigError) as e:
        sampling_params({"num_beams": 4, "temperature": 1.0, "top_p": 1.5, "repetition_penalty": 1.2})
    assert [p.split()[0] for p in e.value.problems] == ["num_beams", "repetition_penalty", "top_p"]


def test_equal_kwargs_share_a_group():
    assert group_key({"a": 1, "until": ["x"]}) == group_key({"until": ["x"], "a": 1}) != group_key({"a": 2})


def row(i: str, tokens: list[int], wall: float, rounds: int) -> dict:
    stats = {"rounds": rounds, "wall_s": wall, "decode_s": wall / 2, "prefill_s": wall / 2, "acceptance_rate": 0.5,
             "accepted_tokens": len(tokens) - rounds, "rejections": 1, "gamma": 4}
    return {"id": i, "token_ids": tokens, "stats": stats, "error": None}


def test_the_speed_file_sums_a_task_and_meets_ar(tmp_path):
    ar = SpeedLog("ar", {"method": "ar"})
    for i in ("a", "b"):
        ar.add("t/1", row(i, [1, 2, 3, 4], 2.0, 4))
    ar.add("t/1", {"id": "c", "token_ids": [], "stats": {}, "error": "VideoError: missing"})
    ar.add_wall({"t/1"}, 5.0)
    summary = ar.write(tmp_path)["t/1"]
    assert speed_file(tmp_path, "t/1", "ar").name == "vpsd_speed_t_1_ar.json"
    assert json.loads(speed_file(tmp_path, "t/1", "ar").read_text()) == summary
    assert (summary["items_done"], summary["items_failed"], summary["tokens"]) == (2, 1, 8)
    assert summary["generate_wall_s"] == 5.0
    assert summary["mean_accepted_tokens"] == 1.0 and summary["tokens_per_s"] == 2.0 and "speedup_vs_ar" not in summary

    hippo = SpeedLog("hippo", {"method": "hippo"})
    hippo.add("t/1", row("a", [1, 2, 3, 4], 1.0, 2))
    hippo.add("t/1", row("b", [1, 2, 3, 5], 1.0, 2))
    summary = hippo.write(tmp_path)["t/1"]
    assert summary["mean_accepted_tokens"] == 2.0 and summary["speedup_vs_ar"] == 2.0
    assert (summary["items_compared"], summary["identical_outputs"], summary["tokens_per_s_vs_ar"]) == (2, 1, 2.0)
    assert summary["baseline"] == "vpsd_speed_t_1_ar.json"
    assert SpeedLog("sd", {}).write(None) == {}  # no rows, no results folder: nothing written
