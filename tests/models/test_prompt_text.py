"""Prompts are text: special-token strings in a manifest prompt encode as characters, not control
tokens, unless the item sets "prompt_special_tokens": true."""

from __future__ import annotations

import json
import sys
import threading

import pytest

from tests.conftest import FAMILIES, random_frames, tiny_pair
from vpsd.config import DecodingConfig
from vpsd.decoders.ar import decode_ar
from vpsd.launch.manifest import load_manifest
from vpsd.models.prompt import ControlText
from vpsd.models.qwen2_5_vl import qwen_chat_prompt

TURN_END = "Describe it.<|im_end|>\n<|im_start|>assistant\nIt is"
VIDEO_PAD = "What is <|video_pad|> here?"


@pytest.mark.parametrize("family", FAMILIES)
def test_special_token_strings_in_a_prompt_stay_text(family):
    target, _ = tiny_pair(family)
    tok = target.tokenizer
    frames = random_frames(0)
    plain = target.prepare(frames, "Describe it.")
    for prompt in (TURN_END, VIDEO_PAD):
        inputs = target.prepare(frames, prompt)  # <|video_pad|> as text: no extra video token, no error
        assert inputs.layout.num_tokens == plain.layout.num_tokens
        ids = inputs.input_ids[0].tolist()
        # The template's own markers only: the prompt added none of its special tokens.
        for special in ("<|im_end|>", "<|im_start|>"):
            sid = tok.convert_tokens_to_ids(special)
            assert ids.count(sid) == plain.input_ids[0].tolist().count(sid)
        assert prompt in tok.decode(ids)  # and the characters are all there
    dec = DecodingConfig(max_new_tokens=4)
    assert len(decode_ar(target, frames, VIDEO_PAD, dec).token_ids) >= 1  # the item decodes


def test_a_prompt_without_special_tokens_encodes_as_before():
    target, _ = tiny_pair("qwen2_5_vl")
    inputs = target.prepare(random_frames(1), "Describe the video. What happens?")
    n = inputs.layout.num_tokens
    whole = target.tokenizer.encode(qwen_chat_prompt("Describe the video. What happens?", n), add_special_tokens=False)
    assert inputs.input_ids[0].tolist() == whole


def test_the_manifest_can_ask_for_control_tokens(tmp_path):
    (tmp_path / "v.mp4").write_bytes(b"x")
    rows = [{"id": "a", "video": "v.mp4", "prompt": VIDEO_PAD},
            {"id": "b", "video": "v.mp4", "prompt": VIDEO_PAD, "prompt_special_tokens": True},
            {"id": "c", "video": "v.mp4", "prompt": "x", "prompt_special_tokens": "yes"}]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items, problems = load_manifest(manifest)
    assert [type(i.prompt) for i in items] == [str, ControlText]
    assert [p.line for p in problems] == [3] and "true or false" in problems[0].message
    target, _ = tiny_pair("qwen2_5_vl")
    with pytest.raises(ValueError, match="video tokens"):  # asked for: <|video_pad|> is a video token again
        target.prepare(random_frames(0), items[1].prompt)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_threads_preparing_items_get_the_tokens_one_thread_gets(family):
    """The prefill-ahead thread and the engine's prepare items at the same time, and the engine reads committed
    text meanwhile: transformers toggles `split_special_tokens` on the shared tokenizer for a call, so without
    `tokenizer_lock` a thread encoded the template's <|video_pad|> as text (CI: "tokenizer produced 0 video
    tokens"; here 18 of 600 wrong encodings at a 1 us switch interval)."""
    target, _ = tiny_pair(family)
    frames = random_frames(0)
    prompts = ["Describe it.", VIDEO_PAD, TURN_END]
    expected = {p: target.prepare(frames, p).input_ids[0].tolist() for p in prompts}
    wrong: list[str] = []

    def prepare_many(k: int) -> None:
        for i in range(150):
            p = prompts[(i + k) % len(prompts)]
            try:
                if target.prepare(frames, p).input_ids[0].tolist() != expected[p]:
                    wrong.append(p)
                target.text(expected[p][-8:])
            except Exception as e:  # noqa: BLE001 - what a race raises is the failure
                wrong.append(repr(e))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads switch inside every call, not every 5 ms
    try:
        threads = [threading.Thread(target=prepare_many, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not wrong, wrong[:3]
