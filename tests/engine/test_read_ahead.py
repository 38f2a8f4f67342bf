"""PrefillAhead's read-ahead (engine/prefill_ahead.py): each item's video read starts as the item is taken, and
where the items are this pipeline's alone, items are taken until `read_ahead` wait to be admitted, in manifest
order; where other pipelines share them, no more are taken than preparing needs."""

from __future__ import annotations

import threading

from vpsd.engine.prefill_ahead import ListSource, PrefillAhead


def _ahead(items: list[str], shared: bool, read_ahead: int, release: threading.Event):
    told: list[str] = []

    def prepare(items: list[str], hint: str | None) -> list[str]:
        assert release.wait(10)
        return [item.upper() for item in items]

    ahead = PrefillAhead(ListSource(items), size=1, prepare=prepare, cpus=None, shared=shared, read=told.append,
                         read_ahead=read_ahead)
    return ahead, told


def test_items_are_read_ahead_in_order_up_to_read_ahead():
    release = threading.Event()
    ahead, told = _ahead([f"i{k}" for k in range(10)], shared=False, read_ahead=5, release=release)
    try:
        ahead.top_up(in_flight=1)  # one decoding: two prepared ahead (reserve), read ahead to five
        assert told == ["i0", "i1", "i2", "i3", "i4"]
        assert len(ahead.ahead) + len(ahead.queue) == 5
        release.set()
        got = []
        while (nxt := ahead.next_ready(block=True)) is not None and len(got) < 3:
            got.append(nxt[1])
            ahead.pop()
            ahead.top_up(in_flight=1)
        assert got == ["I0", "I1", "I2"]
        assert told == [f"i{k}" for k in range(8)]  # each item told once, in order, as it was taken
    finally:
        release.set()
        ahead.close()


def test_shared_items_are_not_taken_only_to_read_them():
    release = threading.Event()
    ahead, told = _ahead([f"i{k}" for k in range(10)], shared=True, read_ahead=5, release=release)
    try:
        ahead.top_up(in_flight=1)
        assert told == ["i0"]  # one prepared beyond the free slots, read as it is taken; no more
    finally:
        release.set()
        ahead.close()
