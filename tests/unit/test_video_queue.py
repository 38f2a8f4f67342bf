"""launch/video_queue.py: a video's items go together, to the pipeline that took its first, and shards keep
videos whole; every item is handed out exactly once."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, strategies as st

from vpsd.launch.video_queue import VideoQueue, deal, groups_of


@dataclass(frozen=True)
class Item:
    id: str
    video: str
    num_frames: int | None = 8
    fps: float | None = None


def items(spec: str) -> list[Item]:
    """'aabca' -> items a0 a1 b2 c3 a4 on videos a, b, c."""
    return [Item(f"{v}{i}", v) for i, v in enumerate(spec)]


def test_one_pipeline_decodes_a_video_s_items_together_in_first_appearance_order():
    q = VideoQueue(items("abacba"))
    got = [q.take(0).id for _ in range(6)]
    assert got == ["a0", "a2", "a5", "b1", "b4", "c3"]
    assert q.take(0) is None and not q


def test_another_frame_request_is_another_group():
    q = VideoQueue([Item("x", "a"), Item("y", "a", num_frames=16), Item("z", "a")])
    assert [q.take(0).id for _ in range(3)] == ["x", "z", "y"]


def test_each_pipeline_keeps_the_video_it_took_and_the_tail_helps_the_largest_group():
    q = VideoQueue(items("aaabbc"))
    assert q.take(0).id == "a0"
    assert q.take(1).id == "b3"  # a is held by pipeline 0
    assert q.take(0).id == "a1"
    assert q.take(2).id == "c5"
    assert q.take(2).id == "a2"  # every group left is held: help the one with the most items left (a: 1, b: 1)
    assert q.take(1).id == "b4"
    assert q.take(0) is None


def test_shards_hold_whole_videos_and_every_item_once():
    its = items("abacbdde")
    shards = [deal(its, i, 3) for i in range(3)]
    assert sorted(i.id for s in shards for i in s) == sorted(i.id for i in its)
    for s in shards:
        assert all(len({i.video for i in g}) == 1 for g in groups_of(s))
    videos = [{i.video for i in s} for s in shards]
    assert all(not (videos[a] & videos[b]) for a in range(3) for b in range(a + 1, 3))


@given(st.text(alphabet="abcde", min_size=0, max_size=30), st.lists(st.integers(0, 3), min_size=1, max_size=80))
def test_any_order_of_asking_hands_every_item_out_exactly_once(spec, askers):
    its = items(spec)
    q = VideoQueue(its)
    got = []
    for p in askers * 40:
        if not q:
            break
        item = q.take(p)
        assert item is not None
        got.append(item.id)
    while q:
        got.append(q.take(0).id)
    assert sorted(got) == sorted(i.id for i in its) and len(q) == 0
