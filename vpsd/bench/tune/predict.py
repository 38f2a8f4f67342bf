"""Each candidate's items/hour on this machine, predicted from what measure.py measured (pure: no model, no clock).

Per item, its prefill work and its decode rounds:
- decode: `ar` steps one token at a time (its measured step at B = 1). A draft in turns with the target (serial; a
  parallel method over a batch, drafting in the target's process) costs per round its forwards and a verify of the
  window, k T_q + T_p(k + 1), over the rounds agreement.py replays for the item (a tree: its levels' forwards and a
  verify of its nodes). A draft beside the target (a parallel method at B = 1) costs per replayed round the
  longer of its window's drafting and the verify with a round's messaging, max(gamma T_q, T_p(gamma + 1) + ovh),
  and after each rejection a window drafted while the target waits, gamma T_q. That departs from ParallelVLM's
  Theorem 6 (App. C, which `vpsd bench methods` prints beside its rows): its expectation over i.i.d.
  acceptances at tau_hat priced the short pair's parallel rows 25-30% slower than their jobs, whose windows are
  long (gamma ~14) and whose rejections cluster; the item's own rounds are what a serial run's are priced by too.
  Over a batch a round of b items in flight costs its forwards at b rows (between the measured one item's and
  full batch's, simulate.py; TABED's draft b forwards of one item's views, as its proposer runs them); pipelined,
  the longer of the draft's window and the verify, then the wait for windows drafted again after a rejection,
  and each item is verified only once the draft rank has started it (its side of the prefill, a first window).
- prefill: the target's vision and prefill; a draft's vision, selection and pruned prefill in turn (serial), or
  beside the target's prefill on another core (a parallel method's synchronous prefill: the longer of the two).
The job is then played out as the engine runs it (simulate.py): at B = 1 one item after another; over a batch a
prefill thread beside the decode thread, the batch's ramp and tail included, for the confirming job's items (the
sample, grown to a batch). items/hour = 3600 n / the job's seconds; the first `ar` job's ratio to its own
prediction then scales every candidate at its batch size (with_job_factor).
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
from vpsd.bench.tune.simulate import ItemWork, makespan
from vpsd.config import SERIAL_AUTO_GAMMA, RunConfig
from vpsd.pipeline.cost import CostModel, ParallelWindow, SerialWindow
from vpsd.pipeline.methods import get_method
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
    job_factor: float = 1.0  # how much slower its batch size's jobs run than their forwards (with_job_factor)


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
        if key.kind == "views":  # TABED feeds each item's views in a forward of its own (engine/proposers.py)
            return single * c.batch
        return single * self.t_p(it, c.batch, 1) / it.verify_s[1]  # std: as the target's forward scales

    def between(self, batch: int, single: float, full: float, b: int) -> float:
        """A forward of b items in flight in a batch of `batch`: linear from one item's (`single`) to the full
        batch's (`full`), the two measured ends (a forward's cost grows with its rows about linearly: "A forward's
        cost as the context grows", docs/benchmarks.md)."""
        if batch <= 1:
            return single
        return single + (full - single) * (min(b, batch) - 1) / (batch - 1)

    def t_p_at(self, c: Candidate, rows: int, b: int) -> float:
        """A target forward of `rows` rows for each of b items in flight (c's batch size)."""
        single = statistics.fmean(self.t_p(it, 1, rows) for it in self.m.items)
        return self.between(c.batch, single, self.t_p(self.m.items[0], c.batch, rows), b)

    def t_q_at(self, c: Candidate, rows: int, b: int) -> float:
        """A draft forward of `rows` rows for each of b items in flight."""
        single = statistics.fmean(self.t_q(it, replace(c, batch=1), rows) for it in self.m.items)
        return self.between(c.batch, single, statistics.fmean(self.t_q(it, c, rows) for it in self.m.items), b)

    # ---- the job ----------------------------------------------------------------------------------------------

    def job_items(self, batch: int) -> int:
        """Items in the confirming job at `batch`: the sample, grown to a batch's worth (sample.py write_samples)."""
        return max(len(self.m.items), batch) if batch > 1 else len(self.m.items)

    def _played(self, c: Candidate, works: list[ItemWork], round_s) -> float:
        """items/hour of c's job on the sample (simulate.py), its items beyond the sample's measured ones played as
        the measured ones again, in turn."""
        n = self.job_items(c.batch)
        seconds = makespan([works[i % len(works)] for i in range(n)], c.batch, round_s, self.m.cores)
        return 3600 * n / seconds if seconds > 0 else 0.0

    def _tokens_per_s(self, c: Candidate, works: list[ItemWork], round_s) -> float:
        tokens = sum(it.length - 1 for it in self.m.items)
        decode = (sum(w.decode_s for w in works) if c.batch == 1
                  else sum(w.rounds for w in works) * round_s(c.batch) / c.batch)
        return tokens / decode if decode else 0.0

    # ---- plain ------------------------------------------------------------------------------------------------

    def _plain(self, c: Candidate) -> Prediction:
        works = [ItemWork(it.vision_s + it.prefill_s, it.length - 1, (it.length - 1) * it.ar_step_s)
                 for it in self.m.items]

        def round_s(b: int) -> float:
            return self.t_p_at(c, 1, b)

        return Prediction(c, self._played(c, works, round_s), self._tokens_per_s(c, works, round_s),
                          statistics.fmean(w.prefill_s for w in works), None, None, None, None, None)

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
        rows = tree.num_nodes + 1 if tree is not None else gamma + 1
        works = [self._item(it, c, gamma, tree) for it in self.m.items]
        ovh = self._messaging_s(c)
        rejected = pooled.rejections / pooled.rounds if pooled.rounds else 0.0  # an item's rounds that reject

        def round_s(b: int) -> float:
            """A batch's round of b items verified: in turns, the draft's forwards then a verify; pipelined, the
            longer of the two (the draft drafts the next window while the target verifies this one), then the wait
            for the windows drafted again after a rejection (`redraft_wait_s`)."""
            draft = (_tree_draft_s(tree, lambda rows: self.t_q_at(c, rows, b)) if tree is not None
                     else gamma * self.t_q_at(c, 1, b))
            verify = self.t_p_at(c, rows, b)
            if not c.overlapped:
                return draft + verify
            return max(draft, verify + ovh) + redraft_wait_s(b, rejected, verify,
                                                             lambda k: gamma * self.t_q_at(c, 1, k))

        it0 = self.m.items[0]
        return Prediction(c, self._played(c, works, round_s), self._tokens_per_s(c, works, round_s),
                          statistics.fmean(w.prefill_s for w in works), float(gamma), pooled.mat, pooled.tau,
                          1e3 * statistics.fmean(self.t_p(it, c.batch, rows) for it in self.m.items),
                          1e3 * self.t_q(it0, c))

    def _item(self, it: ItemMeasure, c: Candidate, gamma: int, tree: DraftTree | None) -> ItemWork:
        """One item's prefill, rounds and decode alone (module docstring)."""
        key = c.draft_key(self.cfg)
        d = it.drafts[key.name]
        draft_side = (0.0 if key.kind == "sparse_kv" else it.draft_vision_s) + d.select_s + d.prefill_s
        beside = c.overlapped and c.batch == 1 and self.m.cores > 1
        prefill = it.vision_s + (max(it.prefill_s, draft_side) if beside else it.prefill_s + draft_side)
        r = self.rounds(it, c, gamma, tree)
        rows = tree.num_nodes + 1 if tree is not None else gamma + 1
        t_q = self.t_q(it, replace(c, batch=1))
        if c.overlapped and c.batch > 1:
            # a pipelined batch: the draft rank starts the item after its admission (its side of the prefill, its
            # first window), each in turn; the prefill thread, pinned to the draft's cores below its priority
            # (engine/prefill_ahead.py), yields them that long too (`prefill` keeps the draft's side)
            return ItemWork(prefill, r.rounds, 0.0, draft_side + gamma * t_q)
        if c.overlapped:
            # the draft drafts the next window while the target verifies this one: a round is the longer of the
            # two and its messaging; after a rejection the draft starts its window again from the target's token
            # while the target waits (a departure from Theorem 6's expectation over i.i.d. acceptances: the
            # item's own replayed rounds, as for a serial run)
            per_round = max(gamma * t_q, self.t_p(it, 1, rows) + self._messaging_s(c))
            return ItemWork(prefill, r.rounds, r.rounds * per_round + r.rejections * gamma * t_q)
        if tree is not None:
            draft = _tree_draft_s(tree, lambda n: self.t_q(it, replace(c, batch=1), n))
            return ItemWork(prefill, r.rounds, r.rounds * (draft + self.t_p(it, 1, rows)))
        return ItemWork(prefill, r.rounds, r.draft_steps * t_q + r.rounds * self.t_p(it, 1, rows))

    def _messaging_s(self, c: Candidate) -> float:
        """A round's messaging where c's draft runs beside the target (a rank's round trip, a thread's); 0 in turns."""
        if not c.overlapped:
            return 0.0
        return self.m.overhead_s.get("thread" if c.draft_on == "thread" else "rank", 0.0)

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


def redraft_wait_s(b: int, rejected: float, verify_s: float, redraft_s) -> float:
    """A pipelined batch's wait after a verify of b items for the windows its rejections sent the draft back to
    draft (it drafted on optimistically meanwhile): while any of the b was rejected (each in `rejected` of its
    rounds), the rejected items' window (`redraft_s(k)` for k of them, at least one), at most what the engine's
    straggler patience waits (engine/scheduler.py: half a verify; later ones are verified without them)."""
    if b < 1 or rejected <= 0:
        return 0.0
    any_rejected = 1.0 - (1.0 - rejected) ** b
    return any_rejected * min(redraft_s(max(1.0, rejected * b)), 0.5 * verify_s)


def _tree_draft_s(tree: DraftTree, step_s) -> float:
    """A tree's draft forwards a round: one a level, of that level's nodes (`step_s(rows)`: a forward of rows)."""
    return sum(step_s(len(tree.level(depth))) for depth in range(tree.depth))


def job_factor(ar_predicted: float, ar_measured: float) -> float:
    """How much faster or slower a job runs than the forwards played out (simulate.py): `ar`'s predicted items/hour
    over its first job's. It holds what measure.py cannot see in its one process: the coordinator's hand-off and
    results, the traces, the reader pool's share of the cores, the ranks' and threads' memory traffic beside each
    other, and the cores lent at the manifest's tail (`scaled_by`): 1.00 at B = 1 and 0.96 at B = 8 on the short
    scaled pair, 0.78 on the long one."""
    if ar_predicted <= 0 or ar_measured <= 0:
        return 1.0
    return ar_predicted / ar_measured


def scaled_by(c: Candidate, factor: float) -> float:
    """The job factor a candidate's prediction takes: its batch size's, where the candidate runs in the target's
    process as `ar` does (no draft, or a serial one), whose scheduler lends the prefill thread's cores to its
    forwards at the manifest's tail (engine/prefill_ahead.py); 1 where the draft has a rank or thread of its own,
    which holds those cores. A tune's job is mostly tail (its sample's last items): the long pair's `ar` job ran
    its last two items' prefills on two cores, 0.77-0.79 of its forwards played out, while hippo's jobs, on one, came
    within 2-7% of theirs unscaled (and pearl's on the short pair within 2%)."""
    return 1.0 if c.overlapped else factor


def with_job_factor(predictions: list[Prediction], factor: dict[int, float]) -> list[Prediction]:
    """Every prediction's item time times its batch size's job factor, as `scaled_by` takes it (a departure from
    App. C, which prices the forwards alone). `ar`'s own prediction then equals its calibrating job by
    construction: only the other rows test the model. Proportional, not a fixed time an item: a fixed time taken
    from `ar`'s ~30 rounds an item overcharged a drafted item of ~3 rounds by ~60 ms (predictions 28% low). Order
    kept (best first within each batch size)."""
    out = []
    for p in predictions:
        f = scaled_by(p.candidate, factor.get(p.candidate.batch, 1.0))
        out.append(replace(p, items_per_hour=p.items_per_hour / f, job_factor=f))
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
