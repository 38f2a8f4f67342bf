"""`vpsd serve` takes a chat: a system message (or OpenAI's `developer`), assistant turns, the video in a user turn,
content as a string or a list of parts, and answers the conversation as `ar` decodes its rendering
(vpsd/models/prompt.py); a conversation it cannot answer is a 400 in OpenAI's error shape. The HTTP case runs the real
app (FastAPI on uvicorn, 127.0.0.1) in a thread over `ar` on the embedded world pair, called by OpenAI's client; the
same conversation through `vpsd.LLM.generate` answers the same."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.serve.conftest import app_in_thread
from tests.torchrun_jobs import ROOT
from vpsd.models.prompt import Turn, turns_of
from vpsd.serve.media import MediaError, MediaLimits, parse_messages
from vpsd.serve.schema import ChatCompletionRequest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

CONFIG = ROOT / "configs" / "world_qwen2_5_vl.yaml"
VIDEOS = ROOT / "examples" / "world" / "videos"
CLIP = VIDEOS / "world-001000.mp4"
MAX_TOKENS = 24
VIDEO = {"type": "video_url", "video_url": {"url": str(CLIP)}}
CHAT = [{"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": [{"type": "text", "text": "Describe the video."}, VIDEO]},
        {"role": "assistant", "content": [{"type": "text", "text": "there are two objects."}]},
        {"role": "user", "content": "What happens then?"}]


def parsed(messages: list[dict], tmp_path: Path):
    request = ChatCompletionRequest.model_validate({"messages": messages})
    return parse_messages(request, MediaLimits(allowed_media_dir=VIDEOS), tmp_path)


def test_the_messages_become_the_conversation(tmp_path):
    p = parsed(CHAT, tmp_path)
    assert p.video == str(CLIP.resolve())
    assert turns_of(p.prompt) == [Turn("system", "Answer in one sentence."), Turn("user", "Describe the video.", True),
                                  Turn("assistant", "there are two objects."), Turn("user", "What happens then?")]
    developer = parsed([{"role": "developer", "content": "Be brief."}, *CHAT[1:2]], tmp_path)
    assert turns_of(developer.prompt)[0] == Turn("system", "Be brief.")
    assert parsed(CHAT[1:2], tmp_path).prompt == "Describe the video."  # one user turn: the prompt it always was


@pytest.mark.parametrize(("messages", "code", "says"), [
    ([{"role": "user", "content": [VIDEO]}, {"role": "assistant", "content": "x"},
      {"role": "user", "content": [VIDEO]}], "unsupported_content", "one video a request"),
    ([{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}], "unsupported_messages",
     "needs a user turn"),
    ([{"role": "assistant", "content": [VIDEO]}, {"role": "user", "content": "x"}], "unsupported_content",
     r"messages\[0\] \(assistant\): a video_url part goes in a user turn"),
    ([{"role": "tool", "content": "x", "tool_call_id": "1"}, *CHAT[1:2]], "unsupported_messages",
     r"messages\[0\]: role 'tool' is not supported"),
    ([*CHAT[1:2], {"role": "system", "content": "x"}, {"role": "user", "content": "y"}], "unsupported_messages",
     "a system message may only come first"),
    ([*CHAT[1:2], {"role": "assistant", "content": "y"}], "unsupported_messages", "last message must be a user turn"),
    ([*CHAT[1:2], {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}, {"role": "user", "content": "y"}],
     "unsupported_messages", "tool calls are not supported"),
    ([{"role": "user", "content": "no video"}], "missing_video", "no video"),
])
def test_a_conversation_vpsd_cannot_answer_is_a_400(messages, code, says, tmp_path):
    with pytest.raises(MediaError, match=says) as refused:
        parsed(messages, tmp_path)
    assert (refused.value.status, refused.value.code) == (400, code)


def test_a_chat_is_answered_as_ar_decodes_its_rendering(tmp_path):
    import vpsd
    from vpsd.config import DecodingConfig
    from vpsd.decoders.ar import decode_ar
    from vpsd.serve.app import ServeSettings, create_app
    from vpsd.serve.jobs import JobQueue
    from vpsd.serve.metrics import Metrics
    from vpsd.serve.online import OnlineEngine
    from vpsd.video.item import load_item_frames

    with vpsd.LLM(CONFIG, method="ar") as llm:
        cfg = llm.config
        frames, times = load_item_frames(CLIP, cfg.video.num_frames, None, cfg.video.max_side)
        prompt = parsed(CHAT, tmp_path).prompt
        res = decode_ar(llm.target, frames, prompt, DecodingConfig(max_new_tokens=MAX_TOKENS), times)
        expected = llm.text(res.token_ids)
        api = [{"role": "system", "content": "Answer in one sentence."},
               {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Describe the video."}]},
               {"role": "assistant", "content": "there are two objects."},
               {"role": "user", "content": [{"type": "text", "text": "What happens then?"}]}]
        out = llm.generate(vpsd.VideoRequest(str(CLIP), api), vpsd.SamplingParams(max_new_tokens=MAX_TOKENS))[0]
        assert out.error is None and out.token_ids == res.token_ids[:len(out.token_ids)] and out.text == expected

        metrics = Metrics("world_qwen2_5_vl")
        runner = OnlineEngine(llm, JobQueue(4, 1, metrics))
        settings = ServeSettings("world_qwen2_5_vl", "ar", limits=MediaLimits(allowed_media_dir=VIDEOS),
                                 scratch=tmp_path)
        with app_in_thread(create_app(llm, runner, settings, metrics), runner) as base:
            client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
            answer = client.chat.completions.create(model="world_qwen2_5_vl", messages=CHAT, max_tokens=MAX_TOKENS)
            assert answer.choices[0].message.content == expected
            single = client.chat.completions.create(model="world_qwen2_5_vl", messages=CHAT[1:2], max_tokens=4)
            assert single.choices[0].message.content == llm.text(decode_ar(
                llm.target, frames, "Describe the video.", DecodingConfig(max_new_tokens=4), times).token_ids)
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model="world_qwen2_5_vl", max_tokens=4, messages=[
                    {"role": "assistant", "content": [VIDEO]}, {"role": "user", "content": "x"}])
            error = refused.value.body
            assert error["code"] == "unsupported_content" and error["param"] == "messages"
            assert error["type"] == "invalid_request_error" and "goes in a user turn" in error["message"]
