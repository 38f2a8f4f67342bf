"""`vpsd tune`'s decisions on hand-made measurements (vpsd/bench/tune/): the rounds a draft's ranks replay, the
items/hour each candidate is predicted from the measured forwards, which candidates get confirmed within the time
budget, and the winner: the best measured lossless row, never one whose outputs differ from `ar`'s."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from vpsd.bench.tune.agreement import chain_rounds, tree_rounds, views_rounds
from vpsd.bench.tune.candidates import Candidate, GridSpec, grid, parse_methods
from vpsd.bench.tune.confirm import Confirmed, JobPlan, choose_confirmed, within_budget
from vpsd.bench.tune.measure import DraftItem, ItemMeasure, Measured
from vpsd.bench.tune.predict import Predictor, interpolate, predict_all, redraft_wait_s
from vpsd.bench.tune.simulate import ItemWork, makespan
from vpsd.bench.tune.report import decide
from vpsd.config import load_config
from vpsd.pipeline.tree import DraftTree

ROOT = Path(__file__).resolve().parents[2]
CFG = load_config(ROOT / "configs" / "tiny_qwen2_5_vl.yaml", {"decoding.gamma_min": 1})


def test_a_chain_accepts_the_run_of_agreeing_positions_and_commits_one_more():
    # positions 1..7; the draft disagrees at 3 only. gamma 3: [1, 2 accepted, 3 the target's], [4, 5, 6 + 7].
    r = chain_rounds([0, 0, 1, 0, 0, 0, 0], length=8, max_new=8, gamma=3)
    assert (r.rounds, r.committed, r.drafted, r.accepted, r.rejections) == (2, 7, 6, 5, 1)
    assert r.mat == 3.5 and r.tau == 5 / 6
    # the window shortens before max_new_tokens, as decoders/sd.py's does: 1 + 5 accepted, then 7 plain
    r = chain_rounds([0] * 7, length=8, max_new=8, gamma=5)
    assert (r.rounds, r.committed, r.drafted, r.accepted) == (2, 7, 5, 5)


def test_a_tree_descends_while_the_reference_is_among_a_nodes_children():
    tree = DraftTree.from_branching([2, 1])  # depth 2: two candidates, one child each
    # round 1: position 1 is the draft's second candidate (rank 1), 2 its first: the whole path, 3 the target's;
    # round 2: 4 is rank 1 under the root, 5 rank 1 under it, where there is one child only: rejected;
    # round 3: 6 and 7 on the path, 8 the target's (the last token)
    r = tree_rounds([1, 0, 1, 1, 1, 0, 0, 0], length=9, max_new=9, tree=tree)
    assert (r.rounds, r.committed, r.accepted, r.rejections) == (3, 8, 5, 1)
    first = tree_rounds([1, 0], length=3, max_new=9, tree=tree)
    assert (first.rounds, first.committed, first.accepted) == (1, 2, 2)


def test_tabed_moves_its_weights_to_the_view_that_agrees():
    grid = [[0.0, 1.0], [1.0, 0.0]]  # candidate 0: the second view alone; 1: the first alone
    view_q = [[0.9, 0.1]] * 9  # the first view puts 0.9 on the reference token, the second 0.1
    hits = [[False, True]] * 9  # only the first view's ensemble proposes it
    r = views_rounds(view_q, hits, grid, length=10, max_new=10, gamma=4)
    # block 1 starts at uniform's nearest (candidate 0, tied): rejected at once; position 1 verified, candidate 1
    # is the nearer, and accepts everything after: 4 of 4, then 2 of 2 before max_new_tokens
    assert (r.rounds, r.committed, r.accepted, r.rejections) == (3, 9, 6, 1)


def item(ranks: list[int], length: int = 11) -> ItemMeasure:
    chain = DraftItem(kept=8, select_s=0.0, prefill_s=0.05, step_s={1: 0.002, 2: 0.0025, 4: 0.003, 8: 0.004},
                      ranks=ranks)
    return ItemMeasure("a", length, length, 64, 80, 0.1, 0.4, 0.01, {1: 0.01, 2: 0.012, 4: 0.016, 8: 0.024},
                       draft_vision_s=0.02, drafts={"chain:none@0": chain})


def measured(ranks: list[int]) -> Measured:
    return Measured([item(ranks)], {8: {1: 0.04, 2: 0.05, 4: 0.07, 8: 0.11}}, {8: {"chain@0": 0.006}},
                    {"rank": 0.001, "thread": 0.0002}, cores=2)


def test_predictions_by_hand():
    """ar: 3600 / (P + N T_ar); sd: its replayed rounds' forwards; pearl: its replayed rounds, each the longer of
    drafting the window and a verify with its messaging, its draft's prefill beside the target's; a batch: the job
    played out (simulate.py)."""
    p = Predictor(measured([0] * 10), CFG)
    assert p.predict(Candidate("ar", "none", 0.0, "auto", 1)).items_per_hour == pytest.approx(3600 / 0.6)
    sd = p.predict(Candidate("sd", "none", 0.0, 4, 1))  # rounds of 5 + 5 tokens: 8 draft steps, 2 verifies of 5 rows
    assert interpolate({4: 0.016, 8: 0.024}, 5) == pytest.approx(0.018)
    assert sd.items_per_hour == pytest.approx(3600 / (0.57 + 8 * 0.002 + 2 * 0.018))
    assert (sd.mat, sd.tau, sd.gamma_used) == (5.0, 1.0, 4.0)
    pearl = p.predict(Candidate("pearl", "none", 0.0, 4, 1))  # 2 rounds of max(4 T_q, T_p(5) + a socket's trip)
    assert pearl.items_per_hour == pytest.approx(3600 / (0.1 + max(0.4, 0.02 + 0.05) + 2 * max(4 * 0.002, 0.019)))
    thread = p.predict(Candidate("pearl", "none", 0.0, 4, 1, draft_on="thread"))
    assert thread.items_per_hour > pearl.items_per_hour  # a queue's round trip is cheaper than a socket's
    ar8 = p.predict(Candidate("ar", "none", 0.0, "auto", 8))
    # 8 copies of the item (the job's sample grown to a batch), prefilled 0.5 s each: the prefill thread takes
    # items 0-3 in order while the decode thread, its batch under half full, prefills 7, 6, 5, 4 (simulate.py);
    # all 8 are in by 2.0 s, then 10 rounds of the full batch's 0.04 s
    assert ar8.items_per_hour == pytest.approx(3600 * 8 / (2.0 + 10 * 0.04))


def test_auto_and_best_windows_come_from_the_same_costs():
    p = Predictor(measured([0, 0, 0, 1, 0, 0, 0, 1, 0, 0]), CFG)
    best = p.predict(Candidate("sd", "none", 0.0, "best", 1))
    fixed = [p.predict(Candidate("sd", "none", 0.0, g, 1)).items_per_hour
             for g in range(CFG.decoding.gamma_min, CFG.decoding.gamma_max + 1)]
    assert isinstance(best.candidate.gamma, int) and best.items_per_hour == max(fixed)
    assert p.predict(Candidate("sd", "none", 0.0, "auto", 1)).gamma_used == 5  # the baselines' serial window
    auto = p.predict(Candidate("pearl", "none", 0.0, "auto", 1))
    assert CFG.decoding.gamma_min <= auto.gamma_used <= CFG.decoding.gamma_max  # ParallelWindow's choice
    # never drafting beats drafting where the draft never agrees: the serial window falls back to plain rounds
    plain = Predictor(measured([1] * 10), CFG).predict(Candidate("sd", "none", 0.0, "auto", 8))
    assert plain.gamma_used == 0.0


def test_the_grid_and_what_gets_confirmed():
    spec = GridSpec(parse_methods("sd,hippo,tabed"), ["hippo", "random"], [0.5, 0.9], ["auto", 3], ["rank", "thread"],
                    [1, 8])
    cands = grid(spec)
    labels = [c.label for c in cands]
    assert labels[0] == "ar B=1" and "hippo+random@0.5 g=3:thread B=1" in labels and "sd g=auto B=8" in labels
    assert not any(c.method == "tabed" and c.batch == 8 and not c.pipelined for c in cands)  # batches pipelined only
    assert Candidate("hippo", "hippo", 0.9, "auto", 1).nproc == 3 and Candidate("sd", "none", 0, 3, 1).nproc == 1
    preds = predict_all(measured([0] * 10), CFG, [Candidate("ar", "none", 0.0, "auto", 1),
                                                  Candidate("sd", "none", 0.0, "best", 1),
                                                  Candidate("pearl", "none", 0.0, "auto", 1)])
    chosen = choose_confirmed(preds, 1)
    assert [p.candidate.method for p in chosen[1]] == [preds[0].candidate.method] != ["ar"]
    # two placements of one draft are told apart least: another draft is confirmed before the second of them
    preds = predict_all(measured([0] * 10), CFG, [Candidate("pearl", "none", 0.0, 4, 1, draft_on=d)
                                                  for d in ("rank", "thread")] + [Candidate("sd", "none", 0.0, 4, 1)])
    assert [p.candidate.label for p in preds] == ["pearl g=4:thread B=1", "pearl g=4 B=1", "sd g=4 B=1"]
    assert [p.candidate.label for p in choose_confirmed(preds, 2)[1]] == ["pearl g=4:thread B=1", "sd g=4 B=1"]


def test_the_time_budget_cuts_the_worst_predicted_first_never_a_batch_sizes_best(tmp_path):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"id": "a"}\n' * 4)
    preds = predict_all(measured([0] * 10), CFG, [Candidate("ar", "none", 0.0, "auto", 1),
                                                  *(Candidate("sd", "none", 0.0, g, 1) for g in (1, 9)),
                                                  Candidate("pearl", "none", 0.0, 4, 1)])
    ar = {1: preds[-1]}
    chosen = choose_confirmed(preds, 3)
    plan = JobPlan("c", {1: manifest}, tmp_path, [], [], budget_s=1e6)
    assert len(within_budget(chosen, ar, plan, startup_s=10.0, spent_s=0.0)[1]) == 3
    plan.budget_s = 10.0 * 2 + 10.0 * 2  # two ar jobs and two candidates' start-ups, roughly
    assert [p.candidate for p in within_budget(chosen, ar, plan, 10.0, 0.0)[1]] == [chosen[1][0].candidate]


def row(method: str, iph: float, identical: int = 2, batch: int = 1, ties: int = 0, code: int = 0) -> Confirmed:
    return Confirmed(Candidate(method, "none", 0.0, "auto", batch), items_per_hour=iph, x_ar=iph / 100,
                     items=2, identical=identical, ties=ties, exit_code=code)


def test_the_winner_is_the_best_measured_lossless_row():
    rows = [row("ar", 100), row("sd", 150, identical=1), row("pearl", 120), row("hippo", 119, identical=1, ties=1),
            row("std", 500, code=1), row("ar", 300, batch=8), row("sd", 310, batch=8)]
    v = decide(rows)
    assert v.winner.candidate.method == "sd" and v.winner.candidate.batch == 8  # sd B=1 differs from ar: never
    assert v.runner_up.candidate.method == "ar"
    assert v.by_batch[1].candidate.method == "pearl"  # over hippo, whose one difference is a tie: lossless too
    assert any(d.startswith("sd g=auto B=1 (1/2 same)") for d in v.disqualified)
    assert any(d.startswith("std") and "exit 1" in d for d in v.disqualified)


def test_measurements_survive_their_json(tmp_path):
    m = measured([0] * 10)
    back = Measured.from_json(json.loads(json.dumps(asdict(m))))
    assert back == m


def test_a_jobs_factor_from_ar_scales_every_prediction_at_its_batch_size():
    from vpsd.bench.tune.predict import job_factor, with_job_factor

    # ar predicted 600 items/hour, its first job ran 400: jobs run 1.5x slower than their forwards played out
    assert job_factor(600.0, 400.0) == pytest.approx(1.5)
    assert job_factor(0.0, 400.0) == 1.0
    preds = predict_all(measured([0] * 10), CFG, [Candidate("ar", "none", 0.0, "auto", 1),
                                                  Candidate("sd", "none", 0.0, 4, 1),
                                                  Candidate("pearl", "none", 0.0, 4, 1),
                                                  Candidate("ar", "none", 0.0, "auto", 8)])
    raw = {p.candidate: p.items_per_hour for p in preds}
    out = with_job_factor(preds, {1: 1.5})
    for p in out:
        # ar and sd run in the target's process (lent the prefill cores at the tail); pearl's draft has a rank
        f = 1.5 if p.candidate.batch == 1 and p.candidate.method != "pearl" else 1.0
        assert p.job_factor == f
        assert p.items_per_hour == pytest.approx(raw[p.candidate] / f)
    assert [p.candidate.batch for p in out] == sorted(p.candidate.batch for p in out)


def test_a_candidate_runs_only_if_its_job_could_change_the_choice():
    from vpsd.bench.tune.confirm import PREDICTION_TIE, PREDICTION_TOLERANCE, _not_worth_it, could_win, ties

    assert (PREDICTION_TOLERANCE, PREDICTION_TIE) == (0.15, 0.02)  # issue 63's bound on the predictions; a tie
    assert could_win(100.0, 0.0)  # nothing measured yet: the best predicted always runs
    assert could_win(100.0, 114.9)  # 15% off would make it the best
    assert not could_win(100.0, 115.1)
    assert ties(100.0, 98.0) and not ties(100.0, 97.9)
    preds = {p.candidate.gamma: p for p in predict_all(measured([0] * 10), CFG,
                                                        [Candidate("sd", "none", 0.0, g, 1) for g in (2, 3, 4)])}
    g2, g3, g4 = (preds[g].items_per_hour for g in (2, 3, 4))
    assert g3 / g4 > 0.98 > g2 / g4  # g=3 predicted 1.6% below g=4, g=2 2.5% below
    assert _not_worth_it(g4, [], 1.0) is None
    # g=4 confirmed as predicted: g=3 is a tie with it, g=2 is not (and could still win)
    assert "a tie with sd g=4 B=1" in _not_worth_it(g3, [(preds[4], g4)], 1.0)
    assert _not_worth_it(g2, [(preds[4], g4)], 1.0) is None
    # g=4 measured 30% above its prediction: a tie with a mispredicted candidate says nothing, but g=3 cannot win
    assert "more than 15% below the best measured" in _not_worth_it(g3, [(preds[4], 1.3 * g4)], 1.0)
    # measured 30% below: the tie is no reason either, and g=3 could win
    assert _not_worth_it(g3, [(preds[4], 0.7 * g4)], 1.0) is None
    # predictions are compared at the job factor's scale
    assert "a tie" in _not_worth_it(g3 / 2, [(preds[4], g4 / 2)], 2.0)


def test_the_candidates_are_chosen_again_once_the_job_factor_scales_those_run_as_ar_is():
    from vpsd.bench.tune.confirm import _chosen_again

    preds = predict_all(measured([0] * 10), CFG, [Candidate("sd", "none", 0.0, 4, 1),
                                                  Candidate("pearl", "none", 0.0, 4, 1)])
    raw = {p.candidate.method: p for p in preds}
    assert raw["pearl"].items_per_hour > raw["sd"].items_per_hour
    assert [p.candidate.method for p in _chosen_again(preds, 1, 1.0, 1)] == ["pearl"]
    # ar's job ran at 0.5 of its forwards played out: sd, run as ar is, doubles; pearl (a draft rank) does not
    again = _chosen_again(preds, 1, 0.5, 2)
    assert [p.candidate.method for p in again] == ["sd", "pearl"]
    assert again[0] is raw["sd"]  # unscaled: confirm scales them itself


def test_a_pipelined_batch_waits_for_its_draft_ranks_first_windows_and_its_redrafts():
    """A pipelined batch (pearl over B = 8, its draft on a rank): each item's prefill on the thread keeps the
    draft's side (the thread yields the draft's cores), the draft rank starts each admitted item in turn (that side
    and a first window) before it is verified, and a round is the longer of drafting and verifying, then the wait
    for windows drafted again after rejections: while any of the b items was rejected, their window, at most half a
    verify (engine/scheduler.py's straggler patience)."""
    p = Predictor(measured([0] * 10), CFG)
    c = Candidate("pearl", "none", 0.0, 4, 8, pipelined=True)

    def round_s(b: int) -> float:  # no rejection: no wait
        t_q = 0.002 + (0.006 - 0.002) * (b - 1) / 7  # one item's draft step to the batch's, linear in b
        t_p = 0.018 + (0.08 - 0.018) * (b - 1) / 7  # a 5-row verify (interpolated) from one item's to 8's
        return max(4 * t_q, t_p + 0.001)

    work = ItemWork(0.1 + 0.4 + (0.02 + 0.0 + 0.05), 2, 0.0, draft_start_s=0.07 + 4 * 0.002)
    expected = 3600 * 8 / makespan([work] * 8, 8, round_s, cores=2)
    assert p.predict(c).items_per_hour == pytest.approx(expected)
    # the wait by hand: 8 items each rejected in a quarter of their rounds: 1 - 0.75^8 of rounds wait for the
    # window of 2 items (redraft_s(2) = 0.01), or half a verify when that is less
    assert redraft_wait_s(8, 0.25, 0.1, lambda k: 0.005 * k) == pytest.approx((1 - 0.75 ** 8) * 0.01)
    assert redraft_wait_s(8, 0.25, 0.01, lambda k: 0.005 * k) == pytest.approx((1 - 0.75 ** 8) * 0.005)
    assert redraft_wait_s(8, 0.0, 0.1, lambda k: 0.005 * k) == 0.0


def test_tabeds_views_draft_each_item_in_a_forward_of_its_own():
    """TABED's draft over a batch feeds each item's views in its own forward (engine/proposers.py TabedProposer):
    b items cost b forwards, not one wider forward as a chain's batched draft does."""
    c = Candidate("tabed", "uniform", 0.9, 4, 8, pipelined=True)
    m = measured([0] * 10)
    views = DraftItem(kept=8, select_s=0.0, prefill_s=0.05, step_s={1: 0.003, 2: 0.004}, ranks=[0] * 10)
    m.items[0].drafts[c.draft_key(CFG).name] = views
    p = Predictor(m, CFG)
    assert p.t_q(m.items[0], c) == pytest.approx(8 * 0.003)
    assert p.t_q_at(c, 1, 3) == pytest.approx(3 * 0.003)
