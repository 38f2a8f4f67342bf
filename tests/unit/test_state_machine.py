"""Property tests: whatever the draft proposes and however messages interleave, the target commits
exactly its own autoregressive sequence, in both modes and across switches."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from vpsd.pipeline.state_machine import Drop, DraftMachine, Mode, TargetMachine

VOCAB = 5
EOS = 4


def target_next(prefix: list[int]) -> int:
    """A deterministic 'target model': the next token is a hash of the prefix (EOS is rare)."""
    h = 7
    for t in prefix:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB if h % 23 else EOS if len(prefix) > 5 else h % (VOCAB - 1)


def ar_reference(max_new: int) -> list[int]:
    out: list[int] = []
    while len(out) < max_new and (not out or out[-1] != EOS):
        out.append(target_next(out))
    return out


def verify(prefix: list[int], chunk: list[int]) -> tuple[int, int]:
    n = 0
    while n < len(chunk) and chunk[n] == target_next(prefix + chunk[:n]):
        n += 1
    return n, (target_next(prefix + chunk[:n]) if n < len(chunk) else -1)


@settings(max_examples=300, deadline=None)
@given(
    gamma=st.integers(1, 5),
    extra_lookahead=st.integers(0, 6),
    max_new=st.integers(1, 30),
    schedule=st.lists(st.integers(0, 3), min_size=50, max_size=400),
    wrong=st.lists(st.booleans(), min_size=1, max_size=64),
    eager=st.booleans(),
    windows=st.one_of(st.none(), st.lists(st.integers(1, 6), min_size=1, max_size=8)),
    pre_verify=st.lists(st.booleans(), min_size=1, max_size=8),
)
def test_commits_exactly_the_autoregressive_sequence(gamma, extra_lookahead, max_new, schedule, wrong, eager, windows,
                                                     pre_verify):
    """eager: the draft also sends short chunks when the target is idle (DraftMachine.eager_when_idle).
    windows: gamma auto, the window the target sends with each verdict (pipeline/window.py) moves.
    pre_verify: after a rejection the target asks for the first token alone, or for a whole window."""
    target = TargetMachine(max_new_tokens=max_new, eos_token_ids=frozenset({EOS}))
    draft = DraftMachine(gamma=gamma, lookahead=gamma + extra_lookahead, eager_when_idle=eager)
    to_target: deque = deque()
    to_draft: deque = deque()
    modes_seen = set()
    step = 0
    # A fair scheduler: the hypothesis schedule first, then round robin until the target is done.
    while not target.done:
        action = schedule[step] if step < len(schedule) else step % 4
        step += 1
        assert step < 20_000, "no progress"
        if action == 0 and draft.may_draft():
            # The draft proposes the target's token unless the pattern says it errs here.
            pos = len(draft.sequence)
            good = target_next(draft.sequence)
            draft.record_proposal((good + 1) % VOCAB if wrong[pos % len(wrong)] else good)
        elif action == 1:
            chunk = draft.ready_chunk()
            if chunk is not None:
                start, tokens = chunk
                # Chunks are gamma long, but the first after a rollback (1) and, when eager, any chunk sent
                # while nothing was in flight; never longer than gamma.
                assert 1 <= len(tokens) <= draft.gamma
                to_target.append((draft.epoch, *chunk))
        elif action == 2 and to_target:
            epoch, start, tokens = to_target.popleft()
            decision = target.on_chunk(epoch, start, len(tokens))
            if decision is None:
                n, nxt = verify(target.committed, tokens)
                v = target.on_verified(tokens, n, nxt, pre_verify[step % len(pre_verify)])
                modes_seen.add(v.mode)
                to_draft.append(v)
            else:
                assert isinstance(decision, Drop)
        elif action == 3 and to_draft:
            v = to_draft.popleft()
            if windows:
                g = windows[step % len(windows)]
                draft.set_gamma(g, g + extra_lookahead)
            draft.on_verdict(v.epoch, v.committed_len, v.next_token, v.rollback, v.mode)
            # The draft never believes a token the target has not committed.
            assert draft.sequence[: draft.confirmed] == target.committed[: draft.confirmed]
    assert target.output() == ar_reference(max_new)


def test_rejection_switches_to_conservative_and_sends_the_first_token_alone():
    target = TargetMachine(max_new_tokens=20, eos_token_ids=frozenset())
    draft = DraftMachine(gamma=3, lookahead=6)
    for t in [1, 2, 3]:
        draft.record_proposal(t)
    start, chunk = draft.ready_chunk()
    assert (start, chunk) == (0, [1, 2, 3])
    assert target.on_chunk(0, start, 3) is None
    v = target.on_verified(chunk, 1, 9)  # 2 rejected, target says 9
    assert (v.rollback, v.mode, v.epoch, v.committed_len) == (True, Mode.CONSERVATIVE, 1, 2)
    assert target.committed == [1, 9]
    # A chunk drafted before the rollback is stale.
    assert isinstance(target.on_chunk(0, 3, 3), Drop)
    assert draft.on_verdict(v.epoch, v.committed_len, v.next_token, v.rollback, v.mode)
    assert draft.sequence == [1, 9] and draft.epoch == 1
    draft.record_proposal(5)
    assert draft.ready_chunk() == (2, [5])  # conservative: first token alone
    for t in [6, 7, 8]:
        draft.record_proposal(t)
    assert draft.ready_chunk() == (3, [6, 7, 8])
    v = target.on_verified([5], 1, -1)
    assert (v.rollback, v.mode, v.next_token) == (False, Mode.OPTIMISTIC, -1)
    assert target.holds_next_row  # the bonus row verifies the next chunk's first token



def test_eager_draft_sends_a_short_chunk_only_when_the_target_is_idle():
    draft = DraftMachine(gamma=4, lookahead=8, eager_when_idle=True)
    draft.record_proposal(1)
    assert draft.ready_chunk() == (0, [1])  # nothing in flight (item start): the target waits for us
    for t in [2, 3, 4]:
        draft.record_proposal(t)
    assert draft.ready_chunk() is None  # [1] is being verified: keep filling the next chunk
    draft.record_proposal(5)
    assert draft.ready_chunk() == (1, [2, 3, 4, 5])
    for t in [6, 7]:
        draft.record_proposal(t)
    assert draft.on_verdict(0, 1, -1, False, Mode.OPTIMISTIC) is False
    assert draft.ready_chunk() is None  # [2..5] still in flight
    draft.on_verdict(0, 5, -1, False, Mode.OPTIMISTIC)
    assert draft.target_idle()
    assert draft.ready_chunk() == (5, [6, 7])  # all verified: what is drafted goes now, not after 2 more steps

    patient = DraftMachine(gamma=4, lookahead=8, eager_when_idle=False)
    patient.record_proposal(1)
    assert patient.ready_chunk() is None and patient.ready_chunk(flush=True) == (0, [1])

