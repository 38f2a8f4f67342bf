"""The engine: one target, up to N requests in flight, any drafter (or none), one round at a time.

Every method that drafts a chain runs here, at any batch size, with its draft in this process or on its own
rank (`Drafter`, engine/drafters/protocol.py); `ar` is the same engine with no drafter. A request is prefilled (on any
thread), joins the target's `BatchedCache` (its first token drawn from the prefill's logits, as its batch-1
decoder draws it), and from then on every round is

    1. proposals: the drafter's windows for the drafted requests (a local drafter drafts them now; a remote
       one hands over the chunks that arrived); a plain request's proposal is its next token alone;
    2. ONE target forward: each request feeds the committed tokens its cache lacks and its window
       (`CacheCursor.verify_feed`; ragged rows padded with holes), the rows that score each window cut out
       (`window_rows`, with the row the request held from the last round when the window starts there);
    3. commit (`commit_window`, the one rule for every place and batch size): `verify_chunk` (the greedy rule
       on the rows' keyed scores: greedy, or position-keyed sampling; else the speculative-sampling rule on the
       request's own random stream) and the request's `TargetMachine` decide what is committed; the verdict goes
       to the drafter;
    4. the requests that are done (budget, EOS, a stop string in their text) or failed leave; their results
       are final.

The window: a local drafter's rounds take the serial window (draft and target take turns: goodput per round,
falling back to plain batched steps where speculation does not pay), a remote drafter's the parallel one
(Eq. 6 / Theorem 6: the draft runs beside the target); both read one cost model (pipeline/cost.py). With one
request in flight every forward is the batch-1 forward itself (models/batch.py), so the engine at --batch 1
is each method's batch-1 decoder, bit for bit.
"""

from __future__ import annotations

import threading
import time

import torch

from vpsd.activity import doing
from vpsd.config import DecodingConfig, RunConfig
from vpsd.engine.drafters.protocol import Drafter, Proposal
from vpsd.engine.prefix_cache import Reuse, reuse_for
from vpsd.engine.report import EngineReport
from vpsd.engine.sibling_prefill import Siblings
from vpsd.engine.request import Request
from vpsd.models.base import SequenceEmbeddings, VideoLMAdapter
from vpsd.models.batch import BatchedCache, TreeFeed
from vpsd.models.timing import Stopwatch
from vpsd.pipeline.cost import ParallelWindow, SerialWindow, Window
from vpsd.pipeline.drafting_policy import ItemMeans
from vpsd.pipeline.seeds import verify_sampler
from vpsd.pipeline.state_machine import TargetMachine
from vpsd.pipeline.tree import verify_tree
from vpsd.pipeline.verification import greedy_ids, verify_chunk, window_rows
from vpsd.tracing import get_logger, record_span, span
from vpsd.video.errors import VideoError

log = get_logger()


def window_for(dec: DecodingConfig, drafter: Drafter | None, size: int) -> Window:
    """An engine's pacing, chosen with its drafter. Beside the target (a remote drafter streams the pruner its
    signals): Eq. 6 live under gamma auto, else the fixed window. In turns: by goodput under auto at a batch (a
    tree's rounds priced as the tree's rows), else fixed; at batch 1 always the baselines' window, as each
    method's reference decoder drafts (gamma auto: SERIAL_AUTO_GAMMA)."""
    pipelined = drafter is not None and drafter.overlaps_verify
    if pipelined and dec.auto_gamma:
        return ParallelWindow(dec.gamma_start, dec.gamma_min, dec.gamma_max)
    if pipelined:
        return ParallelWindow(int(dec.gamma), 1, max(int(dec.gamma), dec.gamma_max), fixed=True)
    tree = drafter.tree if drafter is not None else None
    return SerialWindow(dec.serial_gamma(), dec.gamma_min, dec.gamma_max, fixed=size == 1 or not dec.auto_gamma,
                        tree=None if tree is None else (tree.depth, tree.num_nodes))


class EngineFailure(RuntimeError):
    """The target's cache and a request's committed tokens disagree: a bug, never an item's fault."""


class Engine:
    def __init__(self, target: VideoLMAdapter, cfg: RunConfig, size: int, drafter: Drafter | None = None) -> None:
        if size < 1:
            raise ValueError(f"batch size must be >= 1, got {size}")
        self.target, self.cfg, self.size, self.drafter = target, cfg, size, drafter
        dec = cfg.decoding
        self.window = window_for(dec, drafter, size)
        self.parallel = self.window.pipelined
        self.batch = BatchedCache(target)
        self.requests: dict[str, Request] = {}
        self.means = ItemMeans()
        self.report = EngineReport(size=size, pipelined=self.parallel)
        self.eos = frozenset(target.eos_token_ids)
        self.lock = threading.Lock()  # the drafting decision is asked from the prefill thread too
        # One video, many questions: the target's prefixes kept and reused (engine/prefix_cache.py; one cache per
        # target model, shared by every engine over it); None: off (reuse.enabled false, a budget of 0, or a target
        # split over ranks: its followers hold their shards of the cache).
        budget = cfg.reuse.budget_bytes
        self.reuse = reuse_for(target, budget) if budget > 0 and target.mirror is None else None
        # A video's prepared pixels, kept for its next question within the frame cache's budget (models/pixel_memo.py)
        for model in (target, getattr(drafter, "draft", None)):
            if model is not None:
                model.pixel_memo.budget = cfg.reuse.frames_bytes

    @property
    def full(self) -> bool:
        return len(self.requests) >= self.size

    # ---- a request's start -------------------------------------------------------------------------

    def prefill(self, request: Request, on_engine_thread: bool, emb: SequenceEmbeddings | None = None) -> Request:
        """The request's vision and full prefill (and the drafter's side of its start, when drafted), on any
        thread; `join` it on the engine's. `on_engine_thread`: a remote drafter streams the pruner its signals
        from inside the prefill; elsewhere they are held until the join. `emb`: its embeddings, when
        `prefill_group` made them. Raises ValueError (or a VideoError) for an item that cannot be decoded."""
        drafted = request.drafted and self.drafter is not None
        if emb is None:
            emb = self._embed(request, drafted, on_engine_thread)
        t0 = time.perf_counter()  # after the embeddings, which `_embed` timed
        try:
            with doing("prefill", request.id, emb.seq_len), \
                    span("item_prefill", item=request.id, tokens=emb.seq_len, drafted=request.drafted,
                         reused=None if emb.reuse is None else emb.reuse.reused):
                if drafted:  # the drafter's target prefill reuses through emb.reuse (engine/pair_prefill.py)
                    request.prefill = self.drafter.prefill(request, emb, on_engine_thread)
                else:
                    request.prefill = self.target.prefill(emb) if emb.reuse is None else emb.reuse.prefill(self.target, emb)
        except ValueError as e:
            if drafted and on_engine_thread:
                self.drafter.finish(request, str(e))  # it was announced: the draft's side lets it go
            raise
        request.prefill_s += time.perf_counter() - t0
        if request.draft_prefill_s is not None:
            with self.lock:
                self.means.observe_draft_prefill(request.draft_prefill_s)
        return request

    def _embed(self, request: Request, drafted: bool, on_engine_thread: bool) -> SequenceEmbeddings:
        """The request's prompt prepared, its reuse planned, and its embeddings (the vision tower, unless reused);
        timed into its prefill_s."""
        t0, request.started = time.perf_counter(), time.time()
        if request.seed is None:  # an item without a seed of its own takes the run's (pipeline/seeds.py)
            request.seed = int(self.cfg.decoding.seed)
        inputs, request.inputs = request.inputs, None
        if inputs is None:
            inputs = self.target.prepare(request.frames, request.prompt, request.frame_times)
        if drafted and on_engine_thread:
            self.drafter.start(request, self.window.draft_ahead())  # the draft reads and embeds the video meanwhile
        try:
            with doing("prefill", request.id, inputs.seq_len):  # vision and prefill: what a peer sees it doing
                reuse = self._reuse_plan(request, inputs)
                with span("vision", item=request.id, reuse=None if reuse is None else reuse.hit):
                    # a drafter reads the video features (the draft's input, a strategy's); `ar` needs none on a hit
                    emb = self.target.embed(inputs) if reuse is None else reuse.embed(self.target, inputs, drafted)
        except ValueError as e:
            if drafted and on_engine_thread:
                self.drafter.finish(request, str(e))
            raise
        request.num_video_tokens = emb.layout.num_tokens
        request.prefill_s = time.perf_counter() - t0
        return emb

    def prefill_group(self, requests: list[Request]) -> list[Request | Exception]:
        """`prefill` of a run of one video's questions (one: on its own), off the engine's thread, together: the first one's prefix computed
        and kept, and every suffix in one forward (engine/sibling_prefill.py); one that cannot join them (reuse
        off, another prefix, a drafter whose prefill reads no kept result) is prefilled on its own. Returns each
        request prefilled, or the ValueError / VideoError it failed with, in order."""
        if len(requests) == 1:
            return [self._prefill_or_error(requests[0])]
        done: dict[str, Request | Exception] = {}
        group, packed = Siblings(self.target), []
        for r in requests:
            drafted = r.drafted and self.drafter is not None
            try:
                emb = self._embed(r, drafted, on_engine_thread=False)
                t0 = time.perf_counter()
                wanted = self._wanted_signals(drafted)
                if wanted is not None and group.join(emb, wanted):  # the first one's prefix computed here
                    packed.append(r)
                    r.prefill_s += time.perf_counter() - t0
                else:
                    done[r.id] = self._prefill_or_error(r, emb)
            except (VideoError, ValueError) as e:
                done[r.id] = e
        if len(packed) > 1:
            t0 = time.perf_counter()
            with span("sibling_prefill", items=[r.id for r in packed], rows=group.rows):
                group.prefill()
            for r in packed:  # the shared forward, shared out
                r.prefill_s += (time.perf_counter() - t0) / len(packed)
        for r in packed:
            done[r.id] = self._prefill_or_error(r, group.emb(r.id))
        return [done[r.id] for r in requests]

    def _prefill_or_error(self, request: Request, emb: SequenceEmbeddings | None = None) -> Request | Exception:
        """`prefill` off the engine's thread, the ValueError / VideoError it raises returned instead."""
        try:
            return self.prefill(request, False, emb)
        except (VideoError, ValueError) as e:
            return e

    def _wanted_signals(self, drafted: bool) -> tuple[int, int] | None:
        """The signal layers a request's prefill will ask of a result kept on its plan ((0, 0): none), or None when
        its prefill would not take one (its drafter prefills otherwise)."""
        if not drafted:
            return (0, 0)
        return self.drafter.prefill_signals(self.target)

    def _reuse_plan(self, request: Request, inputs) -> Reuse | None:
        """How the request's prefill reuses kept prefixes (engine/prefix_cache.py), or None: reuse off, or nothing
        to cut (traced). Every method reuses: a drafted request whose target prefill reads the pruner's signals
        takes them from the same two forwards (models/signals.py), so it prefills as `ar` with reuse does."""
        if self.reuse is None or not request.reuse:
            return None
        return self.reuse.plan(request.id, inputs)

    def reuse_stats(self) -> dict[str, int] | None:
        """The prefix cache's counters (engine/prefix_cache.py ReuseStats: hits, misses, bytes...), None when off:
        what summary.json's `run.reuse` and a server's /metrics read."""
        return None if self.reuse is None else self.reuse.stats()

    def join(self, request: Request) -> Request | None:
        """The prefilled request joins the batch; returns it when its first token already ends it (it never
        joined), else None."""
        pre, request.prefill = request.prefill, None
        drafted = request.drafted and self.drafter is not None
        machine = TargetMachine(request.max_new_tokens, self.eos, item_id=request.id, defer_bonus=self.parallel)
        sampler = verify_sampler(self.cfg.decoding.rule, request.seed)
        if drafted and self.parallel:  # the draft proposes the first token; the prefill's row verifies it
            request.kept_row = pre.logits
        else:  # drawn from the prefill's row, as the item's batch-1 decoder draws it
            machine.committed.append(sampler.token(pre.logits, 0)[0])
            machine.holds_next_row = False
        if not drafted:
            request.stats.record(0, 0)  # as decode_ar counts its first token
            self.report.plain_items += self.drafter is not None
        request.start_decoding(machine, pre.state.length, sampler, self.report.rounds)
        request.look_for_stop(self.target.text)
        if request.done:  # a first token that ends it (EOS, a budget of one, a stop string)
            self._trace_item(request)
            return request
        if drafted:
            self.drafter.join(request, self.window.draft_ahead())
        self.requests[request.id] = request
        self.batch.join(request.id, pre.state)
        log.info("item_admitted", item=request.id, in_flight=len(self.requests), drafted=request.drafted,
                 need_mib=request.kv_bytes / 2**20)
        return None


    # ---- one round ----------------------------------------------------------------------------------

    def round(self) -> tuple[bool, list[Request]]:
        """One round over the requests in flight (module docstring). Returns whether a forward ran, and the
        requests that left (`request.error` set for a failed one)."""
        proposals, plain = self._proposals()
        ran = bool(proposals or plain)
        if ran:
            self._verify(proposals, plain)
        left = []
        for r in self.requests.values():
            r.look_for_stop(self.target.text)
        for r in [r for r in self.requests.values() if r.done or self._error(r)]:
            left.append(self._leave(r))
        return ran, left

    def _proposals(self) -> tuple[dict[str, Proposal], list[Request]]:
        plain = [r for r in self.requests.values() if not (r.drafted and self.drafter is not None)]
        drafted = [r for r in self.requests.values() if r.drafted and self.drafter is not None and not self._error(r)]
        if self.drafter is None or not drafted:
            return {}, plain
        gamma = self.window.choose(len(self.requests), len(drafted))
        if gamma == 0:  # a plain batched round: every request commits one token
            return {}, plain + drafted
        proposals = self.drafter.proposals(drafted, gamma)
        if (step := self.drafter.draft_step()) is not None:
            self._observe_draft_step(*step)
        if not self.parallel:  # a request whose budget leaves no room for a window takes a plain step
            plain += [r for r in drafted if r.id not in proposals]
        return proposals, plain

    def _verify(self, proposals: dict[str, Proposal], plain: list[Request]) -> None:
        feed, first, trees = {}, {}, {}
        for r in plain:
            length, feed[r.id], first[r.id] = r.cursor.verify_feed(r.committed, [])
            self.batch.rollback(r.id, length)
        for rid, p in proposals.items():
            r = self.requests[rid]
            if p.tree is not None:
                length, feed[rid], first[rid], trees[rid] = self._tree_feed(r, p)
            else:
                length, feed[rid], first[rid] = r.cursor.verify_feed(r.committed, p.token_ids)
            if r.machine.holds_next_row != (first[rid] < 0):
                raise EngineFailure(f"the target's cache of item {rid} disagrees with its committed tokens")
            self.batch.rollback(rid, length)
        rows = max(len(t) for t in feed.values())
        gamma = max((p.gamma for p in proposals.values()), default=0)
        tokens = sum(map(len, feed.values()))
        with doing("verify", next(iter(feed)), tokens), \
                span("verify", round=self.report.rounds, items=list(feed), tokens=tokens, rows=rows, gamma=gamma) as fields:
            watch = Stopwatch(self.target.device)
            # exact_verify: one token a forward, the shapes `ar` runs; a tree is one forward whatever is set
            logits = (self.batch.step_rowwise(feed) if self.cfg.decoding.exact_verify and not trees
                      else self.batch.step(feed, trees))
            watch.stop()
            windows = {rid: window_rows(logits[rid], first[rid], self.requests[rid].kept_row) for rid in proposals}
            # Keyed (greedy, or position-keyed sampling): every row's keyed token in one host transfer for the
            # batch (pipeline/verification.py greedy_ids), the round's one host read; the forward's time is read
            # after it, so timing waits for nothing. A tree reads its own rows.
            ids = self._keyed_ids({r.id: logits[r.id][-1:] for r in plain},
                                  {rid: rows for rid, rows in windows.items() if rid not in trees})
            seconds = watch.seconds
            self.window.observe_verify(len(feed), rows, seconds)
            outcome = [self._commit_plain(r, logits[r.id], ids.get(r.id)) for r in plain]
            outcome += [self._commit_window(self.requests[rid], p, windows[rid], ids.get(rid), first[rid])
                        for rid, p in proposals.items()]
            # Per row, in the order of `items`: what reports/acceptance.py reads.
            names = ("drafted", "accepted", "committed", "mode", "start")
            fields.update({name: list(col) for name, col in zip(names, zip(*outcome))})
        self.report.observe_round(len(feed), gamma, seconds)

    def _keyed_ids(self, plain: dict[str, torch.Tensor], chains: dict[str, torch.Tensor]) -> dict[str, list[int]]:
        """The keyed tokens of each plain request's last row and of each chain window's rows (row i at output
        position len(committed) + i), read in one transfer; {} under the rejection rule, whose draws read their
        own rows."""
        if not self.cfg.decoding.rule.keyed:
            return {}
        scores = {}
        for rid, rows in {**plain, **chains}.items():
            r = self.requests[rid]
            n = len(r.committed)
            scores[rid] = r.sampler.scores(rows, list(range(n, n + rows.shape[0])))
        return greedy_ids(scores)

    def _observe_draft_step(self, rows: int, seconds: float) -> None:
        self.window.observe_draft_step(rows, seconds)
        self.report.t_q_s = self.window.cost.t_q(rows)

    def _commit_plain(self, r: Request, logits: torch.Tensor, ids: list[int] | None) -> tuple:
        """A plain step: the next token from the last row, drawn as `ar` draws it (greedy: `ids`, its argmax)."""
        token = ids[-1] if ids is not None else r.sampler.token(logits[-1], len(r.committed))[0]
        r.machine.committed.append(token)
        r.machine.holds_next_row = False
        r.kept_row = None
        r.stats.record(0, 0)
        return 0, 0, 1, None, None

    def _tree_feed(self, r: Request, p: Proposal) -> tuple[int, list[int], int, TreeFeed]:
        """A tree's verify feed: the committed tokens the cache lacks (the last is the root), then every node at
        its chain position under the tree mask (`DraftTree.verify_inputs`). The cursor learns the accepted path
        after the verdict (`_commit_window`)."""
        length, pending = r.cursor.sync(r.committed)
        offsets, visible = p.tree.tree.verify_inputs(len(pending))
        return length, pending + p.token_ids, len(pending) - 1, TreeFeed(offsets + length, visible)

    def _commit_window(self, r: Request, p: Proposal, rows: torch.Tensor, ids: list[int] | None, first: int) -> tuple:
        """Verifies one request's window on its k+1 rows (greedy: `ids`, their argmaxes; a tree: its N+1 rows by
        recursive rejection, pipeline/tree.py) and commits what its batch-1 run would; the verdict goes to the
        drafter. Returns (drafted, accepted, committed) tokens, the mode it was verified in, its start."""
        mode = r.machine.mode.value
        if p.tree is None:
            v = verify_chunk(p.token_ids, p.q, rows, r.sampler, len(r.committed), ids)
            chunk, accepted, token, drafted = p.token_ids, v.num_accepted, v.next_token, v.num_drafted
        else:  # only the accepted path stays in the cache, which then holds what a chain's would
            t = verify_tree(p.tree.tree, p.tree.tokens, p.tree.probs, rows, r.sampler, len(r.committed))
            chunk, accepted, token, drafted = t.emitted(p.tree.tokens)[:-1], t.num_accepted, t.next_token, t.num_drafted
            self.batch.keep(r.id, self.batch.length(r.id) - len(p.token_ids), [n - 1 for n in t.path])
            r.cursor.feed(r.committed[len(r.cursor.fed):] + chunk)
        self.window.observe_round(accepted, drafted)
        self.report.observe_window(accepted, accepted == drafted)
        before = len(r.committed)
        verdict = r.machine.on_verified(chunk, accepted, token, self.window.pre_verify(), self.window.draft_ahead())
        r.kept_row = rows[-1].clone() if r.machine.holds_next_row else None  # not a view of the round's logits
        r.stats.record(accepted, drafted, verdict.committed_len - before)
        # a tree's round rolls back where a candidate was rejected (its last accepted node had children)
        r.stats.rollbacks += (int(verdict.rollback) if p.tree is None
                              else int(bool(p.tree.tree.children[t.path[-1] if t.path else 0])))
        r.windows.append(p.gamma)
        self.drafter.verified(r, verdict, rows)
        return drafted, accepted, verdict.committed_len - before, mode, p.start

    def _error(self, r: Request) -> str | None:
        if r.error is None and r.drafted and self.drafter is not None:
            r.error = self.drafter.error(r)
        return r.error

    def _leave(self, r: Request) -> Request:
        del self.requests[r.id]
        self.batch.leave(r.id)
        drafted = r.drafted and self.drafter is not None
        if drafted:
            self.drafter.finish(r, r.error)
        if r.error is None:
            with self.lock:
                self.means.observe_item(drafted, len(r.committed), time.perf_counter() - r.decode_start,
                                        self.report.rounds - r.joined_round)
            self.report.drafted_rate = self.means.drafted_rate
        self._trace_item(r)
        return r

    def _trace_item(self, r: Request) -> None:
        """The item's span on the timeline: from its prefill's start to its last round."""
        record_span("item", r.started, time.time() - r.started, item=r.id, drafted=r.drafted, error=r.error)
