"""Each candidate's items/hour on this machine, predicted from what measure.py measured (pure: no model, no clock).

Per item, its decode and its prefill work:
- decode: `ar` steps one token at a time (its measured step at B = 1; one B-row forward over B at a batch). A draft in
  turns with the target (serial; a parallel method over a batch, drafting in the target's process) costs per round
  its forwards and a verify of the window, k T_q + T_p(k + 1), over the rounds agreement.py replays for the item
  (a tree: its levels' forwards and a verify of its nodes); over a batch, the round's share B (gamma T_q(B) +
  T_p(B, gamma + 1)) / B at the batch's MAT: the serial window's objective (pipeline/cost.py). A draft beside the
  target (a parallel method at B = 1, or pipelined over a batch) decodes at ParallelVLM Theorem 6's per-token time,
  2 max(gamma T_q, T_p) / ((1 + tau^gamma) E[X]) with tau_hat of the replayed rounds (App. C, as `vpsd bench
  methods` prints it; at most a round a token, which the theorem's tau -> 0 forgets), a round's messaging where
  the draft runs added to T_p.
- prefill: the target's vision and prefill; a draft's vision, selection and pruned prefill in turn (serial), or
  beside the target's prefill on another core (a parallel method's synchronous prefill: the longer of the two).
At B = 1 items run one after the other: items/hour = 3600 n / sum(prefill + decode). Over a batch the next items'
prefills run beside the batch's rounds on the other cores, so the machine's cores bound the sum and the decode
thread its part: 3600 n / max(sum(prefill + decode) / cores, sum(decode)).
Gamma: a fixed window as set; `auto` as the engine would choose it from the same costs and tau (serial at B = 1:
the baselines' 5; else the windows of pipeline/cost.py, fed these measurements); `best` the fixed window of the
highest prediction over [gamma_min, gamma_max].
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from vpsd.bench.tune.agreement import NONE, Rounds, chain_rounds, tree_rounds, views_rounds
from vpsd.bench.tune.candidates import AUTO, BEST, Candidate
from vpsd.bench.tune.measure import ItemMeasure, Measured, cost_key
from vpsd.config import SERIAL_AUTO_GAMMA, RunConfig
from vpsd.pipeline.cost import CostModel, ParallelWindow, SerialWindow
from vpsd.pipeline.methods import get_method
from vpsd.pipeline.theory import parallel_sd_rollback_token_time
from vpsd.pipeline.tree import DraftTree


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate  # its gamma resolved (auto stays auto; `gamma_used` is what it would run)
    items_per_hour: float
    decode_tokens_per_s: float
    prefill_s: float  # mean per item
    gamma_used: float | None  # the window it would draft with (None: no draft; 0: plain rounds)
    mat: float | None
    tau: float | None
    t_p_ms: float | None  # a verify of its window
    t_q_ms: float | None  # a draft forward
    job_overhead_s: float = 0.0  # per item, what a job costs beside the forwards (with_job_overhead)


def interpolate(points: dict[int, float], x: float) -> float:
    """Piecewise-linear through measured (width, seconds) points, extended along the last two at either end."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    lo, hi = (xs[0], xs[1]) if x <= xs[0] else (xs[-2], xs[-1])
    for a, b in zip(xs, xs[1:]):
        if a <= x <= b:
            lo, hi = a, b
            break
    slope = (points[hi] - points[lo]) / (hi - lo)
    return max(points[lo] + slope * (x - lo), 0.0)


class Predictor:
    def __init__(self, measured: Measured, cfg: RunConfig) -> None:
        self.m, self.cfg, self.dec = measured, cfg, cfg.decoding
        self.t_ar1 = statistics.fmean(it.verify_s[1] for it in measured.items)

    def predict(self, c: Candidate) -> Prediction:
        """One candidate; `best` resolved to the fixed window of the highest prediction."""
        if c.gamma == BEST:
            tried = [self.predict(replace(c, gamma=g)) for g in self._fixed_gammas(c)]
            return max(tried, key=lambda p: p.items_per_hour)
        m = get_method(c.method)
        if not m.uses_draft:
            return self._plain(c)
        return self._drafted(c, m.draft_tree(self.dec.tree))

    def _fixed_gammas(self, c: Candidate) -> list[int]:
        if get_method(c.method).tree is not None:
            return [SERIAL_AUTO_GAMMA]
        return list(range(self.dec.gamma_min, self.dec.gamma_max + 1))

    # ---- costs -------------------------------------------------------------------------------------------------

    def t_p(self, it: ItemMeasure, batch: int, rows: float) -> float:
        """A target forward of `batch` items of `rows` rows each (B = 1: this item's; over a batch: the sample's)."""
        if batch == 1:
            return interpolate(it.verify_s, rows)
        return interpolate(self.m.batched_verify_s[batch], rows)

    def t_q(self, it: ItemMeasure, c: Candidate, rows: int = 1) -> float:
        """A draft forward of `rows` rows at B = 1, or of one row for each of B items over a batch."""
        key = c.draft_key(self.cfg)
        single = interpolate(it.drafts[key.name].step_s, rows)
        if c.batch == 1:
            return single
        batched = self.m.batched_draft_s.get(c.batch, {}).get(cost_key(key))
        if batched is not None and key.kind == "chain":
            return batched * single / it.drafts[key.name].step_s[1]
        return single * self.t_p(it, c.batch, 1) / it.verify_s[1]  # std, TABED: as the target's forward scales

    # ---- plain ------------------------------------------------------------------------------------------------

    def _plain(self, c: Candidate) -> Prediction:
        items = self.m.items
        decode = [(it.length - 1) * (it.ar_step_s if c.batch == 1 else self.t_p(it, c.batch, 1) / c.batch)
                  for it in items]
        prefill = [it.vision_s + it.prefill_s for it in items]
        return Prediction(c, self._per_hour(c, prefill, decode), self._tokens_per_s(decode), statistics.fmean(prefill),
                          None, None, None, None, None)

    def _per_hour(self, c: Candidate, prefill: list[float], decode: list[float]) -> float:
        n, p, d = len(prefill), sum(prefill), sum(decode)
        if c.batch == 1:
            return 3600 * n / (p + d) if p + d else 0.0
        bound = max((p + d) / max(self.m.cores, 1), d)
        return 3600 * n / bound if bound else 0.0

    def _tokens_per_s(self, decode: list[float]) -> float:
        tokens = sum(it.length - 1 for it in self.m.items)
        return tokens / sum(decode) if sum(decode) else 0.0

    # ---- drafted ----------------------------------------------------------------------------------------------

    def rounds(self, it: ItemMeasure, c: Candidate, gamma: int, tree: DraftTree | None) -> Rounds:
        d = it.drafts[c.draft_key(self.cfg).name]
        if d.hits is not None:
            t = self.cfg.tabed_settings
            return views_rounds(d.view_q, d.hits, self.m.grid, it.length, it.max_new, gamma, t.distance, t.window)
        if tree is not None:
            return tree_rounds(d.ranks, it.length, it.max_new, tree)
        return chain_rounds(d.ranks, it.length, it.max_new, gamma)

    def pooled(self, c: Candidate, gamma: int, tree: DraftTree | None) -> Rounds:
        total = NONE
        for it in self.m.items:
            total = total + self.rounds(it, c, gamma, tree)
        return total

    def _drafted(self, c: Candidate, tree: DraftTree | None) -> Prediction:
        gamma = self._gamma(c, tree)
        if gamma == 0:  # the serial window's plain rounds: the items decode as batched `ar` (none drafted)
            return replace(self._plain(c), gamma_used=0.0)
        pooled = self.pooled(c, gamma, tree)
        prefill, decode = [], []
        for it in self.m.items:
            p, d = self._item(it, c, gamma, tree, pooled)
            prefill.append(p)
            decode.append(d)
        it0 = self.m.items[0]
        rows = tree.num_nodes + 1 if tree is not None else gamma + 1
        return Prediction(c, self._per_hour(c, prefill, decode), self._tokens_per_s(decode),
                          statistics.fmean(prefill), float(gamma), pooled.mat, pooled.tau,
                          1e3 * statistics.fmean(self.t_p(it, c.batch, rows) for it in self.m.items),
                          1e3 * self.t_q(it0, c))

    def _item(self, it: ItemMeasure, c: Candidate, gamma: int, tree: DraftTree | None, pooled: Rounds
              ) -> tuple[float, float]:
        """(prefill, decode) seconds of one item (module docstring)."""
        key = c.draft_key(self.cfg)
        d = it.drafts[key.name]
        draft_side = (0.0 if key.kind == "sparse_kv" else it.draft_vision_s) + d.select_s + d.prefill_s
        beside = c.overlapped and c.batch == 1 and self.m.cores > 1
        prefill = it.vision_s + (max(it.prefill_s, draft_side) if beside else it.prefill_s + draft_side)
        tokens = it.length - 1
        if c.overlapped:
            ovh = self.m.overhead_s.get("thread" if c.draft_on == "thread" else "rank", 0.0)
            t_q, t_p = self.t_q(it, c), self.t_p(it, c.batch, gamma + 1) + ovh
            # Theorem 6; a round commits one token at least (the target's), which the theorem leaves out
            per_token = min(parallel_sd_rollback_token_time(t_q, t_p, gamma, pooled.tau), max(gamma * t_q, t_p))
            return prefill, tokens * per_token / c.batch
        draft_s = self._tree_draft_s(it, c, tree) if tree is not None else gamma * self.t_q(it, c)
        rows = tree.num_nodes + 1 if tree is not None else gamma + 1
        round_s = draft_s + self.t_p(it, c.batch, rows)
        if c.batch == 1:  # this item's own rounds, each window as long as it was
            r = self.rounds(it, c, gamma, tree)
            if tree is not None:
                return prefill, r.rounds * round_s
            return prefill, r.draft_steps * self.t_q(it, c) + r.rounds * self.t_p(it, 1, rows)
        return prefill, tokens * round_s / pooled.mat / c.batch

    def _tree_draft_s(self, it: ItemMeasure, c: Candidate, tree: DraftTree) -> float:
        """A tree's draft forwards a round: one per level, each of that level's nodes."""
        return sum(self.t_q(it, c, len(tree.level(depth))) for depth in range(tree.depth))

    # ---- the window -------------------------------------------------------------------------------------------

    def _gamma(self, c: Candidate, tree: DraftTree | None) -> int:
        """The window `c` drafts with: fixed, or what the engine's window would choose (module docstring)."""
        if tree is not None:
            return tree.depth if not (c.gamma == AUTO and c.batch > 1) else self._serial_auto(c, tree)
        if c.gamma != AUTO:
            return int(c.gamma)
        if c.overlapped:
            return self._parallel_auto(c)
        return SERIAL_AUTO_GAMMA if c.batch == 1 else self._serial_auto(c, None)

    def _cost(self, c: Candidate, decay: float, tau_gamma: int, tree: DraftTree | None) -> CostModel:
        """The engine's cost model fed this sample's forwards (mean over items) and tau at `tau_gamma`."""
        cost = CostModel(decay)
        widths = self.m.items[0].verify_s if c.batch == 1 else self.m.batched_verify_s[c.batch]
        for k in sorted(widths):
            cost.observe_verify(c.batch * k, statistics.fmean(self.t_p(it, c.batch, k) for it in self.m.items))
        cost.observe_draft_step(1, statistics.fmean(self.t_q(it, replace(c, batch=1)) for it in self.m.items))
        cost.observe_draft_step(c.batch, statistics.fmean(self.t_q(it, c) for it in self.m.items))
        r = self.pooled(c, tau_gamma, tree)
        cost.accepted, cost.rejections = float(r.accepted), float(r.rejections)
        return cost

    def _parallel_auto(self, c: Candidate) -> int:
        w = ParallelWindow(self.dec.gamma_start, self.dec.gamma_min, self.dec.gamma_max)
        w.batch = c.batch
        w.cost = self._cost(c, 0.8, self.dec.gamma_start, None)
        w.observe_draft_step(c.batch, w.cost.t_q(c.batch))  # the window updates on what it is told
        return w.gamma

    def _serial_auto(self, c: Candidate, tree: DraftTree | None) -> int:
        w = SerialWindow(SERIAL_AUTO_GAMMA, self.dec.gamma_min, self.dec.gamma_max,
                         tree=None if tree is None else (tree.depth, tree.num_nodes))
        w.cost = self._cost(c, 0.9, tree.depth if tree is not None else SERIAL_AUTO_GAMMA, tree)
        costs = w.costs(c.batch)
        return min(costs, key=costs.get) if costs else w.initial


def job_overhead(ar_predicted: float, ar_measured: float) -> float:
    """Seconds an item costs a job beyond the forwards the prediction prices: the first `ar` job's seconds per item
    (its loop over its items) less `ar`'s predicted. It holds what measure.py cannot see in its one process: the
    coordinator's hand-off and results, the traces, the reader pool's share of the cores, the ranks' memory traffic
    beside each other (on the tiny pair this was most of an item: predictions ran 2.6-3.4x above the jobs)."""
    if ar_predicted <= 0 or ar_measured <= 0:
        return 0.0
    return 3600 / ar_measured - 3600 / ar_predicted


def with_job_overhead(predictions: list[Prediction], overhead_s: dict[int, float]) -> list[Prediction]:
    """Every prediction with its batch size's per-item job overhead added to an item's time (3600 / items/hour):
    an item's seconds in a job = its forwards' + the overhead, the same for every candidate at that batch size
    (a departure from App. C, which prices the forwards alone). `ar`'s own prediction then equals its calibrating
    job by construction: only the other rows test the model. Order kept (best first within each batch size)."""
    out = []
    for p in predictions:
        ovh = overhead_s.get(p.candidate.batch, 0.0)
        seconds = 3600 / p.items_per_hour + ovh if p.items_per_hour > 0 else 0.0
        out.append(replace(p, items_per_hour=3600 / seconds if seconds > 0 else 0.0, job_overhead_s=ovh))
    return sorted(out, key=lambda q: (q.candidate.batch, -q.items_per_hour))


def predict_all(measured: Measured, cfg: RunConfig, candidates: list[Candidate]) -> list[Prediction]:
    """Every candidate's prediction, resolved (`best` to its window), each resolved candidate once, best first
    within each batch size."""
    p = Predictor(measured, cfg)
    seen: dict[Candidate, Prediction] = {}
    for c in candidates:
        pred = p.predict(c)
        if pred.candidate not in seen:
            seen[pred.candidate] = pred
    return sorted(seen.values(), key=lambda q: (q.candidate.batch, -q.items_per_hour))
