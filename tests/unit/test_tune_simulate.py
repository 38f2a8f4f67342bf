"""A tune's confirming job played out (vpsd/bench/tune/simulate.py) against schedules worked by hand: one item after
another at B = 1; over a batch, the prefill thread in order beside a decode thread that prefills the last items
itself while its batch is under half full, admits in order, and runs rounds whose cost follows the items in
flight."""

from __future__ import annotations

import pytest

from vpsd.bench.tune.simulate import ItemWork, makespan


def flat(b: int) -> float:
    return 0.1


def test_at_batch_one_items_run_one_after_the_other():
    items = [ItemWork(0.5, 10, 1.0), ItemWork(0.2, 3, 0.3)]
    assert makespan(items, 1, flat, cores=2) == pytest.approx(0.5 + 1.0 + 0.2 + 0.3)


def test_a_batch_ramps_up_on_two_threads_then_decodes_together():
    # 4 items of 1 s prefill, 5 rounds each, B = 4: at 0 nothing is ready, so the decode thread prefills item 3
    # while the prefill thread takes item 0; at 1 item 0 is in but alone (under half of 4), so it prefills item 2
    # while the thread takes item 1; at 2 all four are in: 5 rounds of 4 items
    items = [ItemWork(1.0, 5, 0.0)] * 4
    assert makespan(items, 4, lambda b: 0.1 * b, cores=2) == pytest.approx(2.0 + 5 * 0.4)


def test_a_round_costs_what_its_items_in_flight_cost_and_the_tail_thins():
    # B = 2, items prefilled 1 s; item 0 takes 2 rounds, item 1 takes 4. At 0 the decode thread prefills item 1,
    # the thread item 0: both in at 1. Two rounds of 2 (0.2 each), then item 1 alone: two rounds of 0.1.
    items = [ItemWork(1.0, 2, 0.0), ItemWork(1.0, 4, 0.0)]
    assert makespan(items, 2, lambda b: 0.1 * b, cores=2) == pytest.approx(1.0 + 2 * 0.2 + 2 * 0.1)


def test_slots_bound_the_batch_and_a_freed_slot_takes_the_next_item():
    # B = 2 of 3 items (1 s prefill, 3 rounds each, 0.5 s a round whatever the batch). 0-1: the decode thread
    # prefills item 2, the thread item 0. From 1 item 0 decodes (one of two is not under half full) while the
    # thread prefills item 1, in at 2. Rounds from 1, 1.5 (item 0 alone), 2 (with item 1; item 0 done at 2.5);
    # item 2, ready since 1, waited for the slot: rounds from 2.5, 3.0 (item 1 done at 3.5), 3.5 (item 2 at 4.0).
    items = [ItemWork(1.0, 3, 0.0)] * 3
    assert makespan(items, 2, lambda b: 0.5, cores=2) == pytest.approx(4.0)


def test_on_one_core_the_decode_thread_prefills_everything():
    # no prefill thread: at 0 it prefills item 1 (the last not started), at 1 nothing is in and item 0 is not
    # started: it prefills item 0 too; at 2 both decode: 3 rounds of 0.2
    items = [ItemWork(1.0, 3, 0.0)] * 2
    assert makespan(items, 2, lambda b: 0.1 * b, cores=1) == pytest.approx(2.0 + 3 * 0.2)


def test_an_item_with_no_rounds_only_prefills():
    items = [ItemWork(1.0, 0, 0.0), ItemWork(1.0, 2, 0.0)]
    assert makespan(items, 2, flat, cores=2) == pytest.approx(1.0 + 2 * 0.1)


def test_a_draft_rank_starts_each_admitted_item_in_turn_before_it_is_verified():
    # B = 2, a pipelined batch: 1 s prefills (the decode thread takes item 1, the thread item 0: both in at 1),
    # then the draft rank starts item 0 (0.5 s: its first window at 1.5) and item 1 after it (at 2.0). Item 0 is
    # verified alone from 1.5 (3 rounds of one item, done at 1.8); nothing can be verified until item 1's window
    # comes at 2.0; its 3 rounds end at 2.3
    items = [ItemWork(1.0, 3, 0.0, draft_start_s=0.5)] * 2
    assert makespan(items, 2, lambda b: 0.1 * b, cores=2) == pytest.approx(2.0 + 3 * 0.1)
