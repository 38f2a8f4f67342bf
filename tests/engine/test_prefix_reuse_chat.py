"""A follow-up reuses the KV of the turns before it (engine/prefix_cache.py `segment_ends`, issue 62 item 3): a
conversation's prefill is cut after its video and where each user turn after the video begins, so turn 3 of a chat
copies the segments [video], [turn-1 question + answer], ... that turn 2 computed and kept.

Held: the cuts, on each family's tokenized chats (and the embedded world checkpoint's own chat template), are where
its user turns begin, after the video only, the last segment the final user turn and the assistant header; a
single question is cut after its video alone, as it always was; a text that spells the turn marker cuts nothing.
Through the engine, a 3-turn chat's turns in sequence reuse more than the video prefix, and every turn's output
with reuse is its output in a fresh cache token for token (hit vs miss), for `ar` and for drafted methods whose
pruning reads the target's signals (hippo's attention, parallelvlm's UV-Prune rows), which equal `ar`'s; the
signals of a hit equal a miss's bit for bit, read from the final turn's rows alone."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoTokenizer

from tests.conftest import ROOT, random_frames, tiny_pair
from tests.engine.test_prefix_reuse import engine, tokens
from tests.engine_harness import run
from vpsd.engine.engine import Engine
from vpsd.engine.prefix_cache import PrefixReuse, segment_ends, user_turn_ids
from vpsd.engine.request import Request
from vpsd.engine.scheduler import Scheduler
from vpsd.models.prompt import Turn, chat_prompt, encode_chat, render_template, slotted
from vpsd.models.qwen2_5_vl import QWEN_VIDEO_BLOCK
from vpsd.models.signals import prefill_with_signals

ASKED = ["Describe the video.", "Which colours?", "What happens in this video? Answer in detail."]
SYSTEM = Turn("system", "Be brief.")


def chat(answers: list[str], system: bool = True) -> list[Turn]:
    """The conversation after len(answers) answered questions of ASKED, asking the next one (the video in turn 1)."""
    turns = [SYSTEM] if system else []
    for n, question in enumerate(ASKED[:len(answers) + 1]):
        turns.append(Turn("user", question, video=n == 0))
        if n < len(answers):
            turns.append(Turn("assistant", answers[n]))
    return turns


def user_starts(ids: list[int], opener: tuple[int, ...], after: int) -> list[int]:
    """Where `opener` begins in `ids` after position `after`: the expected cuts, found the plain way."""
    n = len(opener)
    return [p for p in range(after + 1, len(ids) - n + 1) if tuple(ids[p:p + n]) == opener]


def check_cuts(tok, inputs, turns: list[Turn]) -> list[int]:
    """The request's cuts, checked against its tokens: after its video, then at each user turn after it; each
    segment after the first opens a user turn, the last is the final question and the assistant header."""
    opener = user_turn_ids(tok)
    assert opener and tok.convert_ids_to_tokens([opener[0]]) == ["<|im_start|>"]
    ids = inputs.input_ids[0].tolist()
    video_end = int(inputs.layout.seq_positions.max()) + 1
    ends = segment_ends(inputs, opener)
    assert ends == [video_end, *user_starts(ids, opener, video_end)]
    assert all(0 < e < len(ids) for e in ends) and ends == sorted(set(ends))
    video_turn = next(n for n, t in enumerate(turns) if t.video)
    assert len(ends) == 1 + sum(t.role == "user" for t in turns[video_turn + 1:])  # one cut an exchange
    for e in ends[1:]:
        assert tok.decode(ids[e:]).startswith("<|im_start|>user")
    if len(ends) > 1:  # the last segment: the final question and the assistant header
        assert tok.decode(ids[ends[-1]:]) == f"<|im_start|>user\n{turns[-1].text}<|im_end|>\n<|im_start|>assistant\n"
    return ends


def test_a_chat_is_cut_after_its_video_and_at_each_later_user_turn(family):
    target, _ = tiny_pair(family)
    tok = target.tokenizer
    frames = random_frames(21, t=4)
    single = target.prepare(frames, ASKED[0])
    assert segment_ends(single, user_turn_ids(tok)) == segment_ends(single) == [
        int(single.layout.seq_positions.max()) + 1]  # one question: as it always was
    answers = ["a small red circle.", "red and blue."]
    cuts = []
    for done in range(3):  # turns 1, 2, 3
        turns = chat(answers[:done])
        inputs = target.prepare(frames, chat_prompt(turns))
        cuts.append((inputs.input_ids[0].tolist(), check_cuts(tok, inputs, turns)))
    for (ids_a, ends_a), (ids_b, ends_b) in zip(cuts, cuts[1:]):  # the next turn shares every earlier cut...
        assert ends_b[:len(ends_a)] == ends_a and len(ends_b) == len(ends_a) + 1
        assert ids_b[:ends_b[len(ends_a) - 1]] == ids_a[:ends_a[-1]]  # ...with the tokens before them
        assert ends_b[-1] > len(ids_a)  # its new cut comes after the earlier turn's prompt and its answer
    # The video in the last user turn: nothing after it to cut; a question that spells the marker cuts nothing.
    late = [Turn("user", "Hello."), Turn("assistant", "Hi."), Turn("user", ASKED[0], video=True)]
    inputs = target.prepare(frames, chat_prompt(late))
    assert segment_ends(inputs, user_turn_ids(tok)) == segment_ends(inputs)
    typed = chat(["<|im_end|>\n<|im_start|>user\nfake"])
    inputs = target.prepare(frames, chat_prompt(typed))
    assert len(check_cuts(tok, inputs, typed)) == 2


def test_the_checkpoints_own_chat_template_is_cut_the_same_way():
    """The embedded world pair's tokenizer renders its own (Qwen2.5-VL's) template: the same cuts, from its ids."""
    tok = AutoTokenizer.from_pretrained(ROOT / "checkpoints" / "world_qwen2_5_vl" / "target")
    turns = chat(["there is one object.", "red."], system=False)
    text = render_template(tok, slotted(turns), QWEN_VIDEO_BLOCK)
    ids = torch.tensor([encode_chat(tok, text, [t.text for t in turns])])
    pad = tok.convert_tokens_to_ids("<|video_pad|>")
    layout = types.SimpleNamespace(seq_positions=(ids[0] == pad).nonzero().flatten())
    inputs = types.SimpleNamespace(input_ids=ids, layout=layout, seq_len=ids.shape[1])
    assert tok.decode(ids[0]).startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert len(check_cuts(tok, inputs, turns)) == 3


def turn_request(frames, answers: list[str], max_new: int) -> Request:
    return Request(f"turn{len(answers) + 1}", chat_prompt(chat(answers)), max_new, frames,
                   video={"item": f"turn{len(answers) + 1}"})


def converse(s: Scheduler, e: Engine, frames, max_new: int, fresh_each: bool) -> tuple[list[Request], list, list]:
    """A 3-turn chat, turn by turn (each asks after the answers so far): its requests, outputs and each turn's
    reused tokens. `fresh_each`: every turn in an empty cache (all misses)."""
    target = e.target
    answers, todo, outs, reused = [], [], [], []
    for _ in range(3):
        if fresh_each:
            e.reuse.cache.reset()
        before = e.reuse_stats()["reused_tokens"]
        item = turn_request(frames, answers, max_new)
        out = run(s, [item])[item.id]
        todo.append(item)
        outs.append(out.token_ids)
        reused.append(e.reuse_stats()["reused_tokens"] - before)
        answers.append(target.text(out.token_ids))
    return todo, outs, reused


@pytest.mark.parametrize("method, size", [("ar", 1), ("hippo", 2), ("parallelvlm", 2)])
def test_turn_three_reuses_the_earlier_turns_and_a_hit_decodes_as_a_miss(method, size):
    family = "qwen2_5_vl"
    target, _ = tiny_pair(family)
    frames = random_frames(22, t=4)
    e, s = engine(family, method, size=size)
    todo, hit, reused = converse(s, e, frames, 8, fresh_each=False)
    ends = [segment_ends(target.prepare(frames, r.prompt), e.reuse.user_turn) for r in todo]
    assert [len(x) for x in ends] == [1, 2, 3]
    # turn 2 reuses the video prefix turn 1 kept; turn 3 also the turn-1 question + answer turn 2 kept
    assert reused == [0, ends[1][0], ends[2][1]] and ends[2][1] > ends[2][0]
    _, miss, missed = converse(s, e, frames, 8, fresh_each=True)  # the same chat, every turn in a fresh cache
    assert missed == [0, 0, 0]
    assert miss == hit  # each answer is the same, so each turn's prompt is too: token for token
    # The whole chat again, every turn known: each reuses every segment but its own last one.
    before = e.reuse_stats()
    again = tokens(run(s, todo))
    after = e.reuse_stats()
    assert [again[r.id] for r in todo] == hit
    assert after["reused_tokens"] - before["reused_tokens"] == sum(x[-1] for x in ends)
    assert after["hits"] - before["hits"] == 3
    if method != "ar":  # drafted: equal to `ar`'s chat with reuse
        e_ar, s_ar = engine(family)
        assert converse(s_ar, e_ar, frames, 8, fresh_each=False)[1] == hit


def test_a_hits_signals_are_a_misss_read_from_the_final_turn(family):
    """Turn 3's prefill with signals (attention and UV-Prune rows) after turn 2's kept its segments: the earlier
    turns are copied, the video rows come from the video segment alone, the text rows are the final turn's; every
    signal, the logits and the cache equal a cold prefill's bit for bit."""
    target, _ = tiny_pair(family)
    frames = random_frames(23, t=4)
    opener = user_turn_ids(target.tokenizer)
    turn2 = target.prepare(frames, chat_prompt(chat(["a small red circle."])))
    turn3 = target.prepare(frames, chat_prompt(chat(["a small red circle.", "red and blue."])))
    ends = segment_ends(turn3, opener)
    results = []
    for warm in (False, True):
        reuse = PrefixReuse(64 * 2**20, opener)
        if warm:
            plan = reuse.plan("turn2", turn2)
            prefill_with_signals(target, plan.embed(target, turn2, True), 2, attention=True, hidden=True)
        plan = reuse.plan("turn3", turn3)
        pre = prefill_with_signals(target, plan.embed(target, turn3, True), 2, attention=True, hidden=True)
        assert len(plan.held) == (2 if warm else 0) and plan.reused == (ends[1] if warm else 0)
        results.append(pre)
    miss, hit = results
    video_pos = turn3.layout.seq_positions
    assert hit.signals.text_hidden.shape[1] == turn3.seq_len - ends[-1]  # the final turn's rows
    assert hit.signals.video_hidden.shape[1] == hit.signals.video_attention.shape[-1] == video_pos.numel()
    assert torch.equal(hit.logits, miss.logits)
    for name in ("video_attention", "video_hidden", "text_hidden"):
        assert torch.equal(getattr(hit.signals, name), getattr(miss.signals, name)), name
    for a, b in zip(hit.state.cache.layers, miss.state.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
