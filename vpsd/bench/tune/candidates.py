"""What `vpsd tune` chooses among: a method, its pruning (strategy and ratio), its window (gamma fixed or auto),
where its draft runs (a rank or threads of the target's process) and the batch size, each one a job could run.

The grid (`grid`): every method at each batch size, at its own strategy; the strategies in the baseline method's
pipeline (hippo's, as `vpsd bench methods` runs them); each pruning method at every ratio; each drafting chain at
every gamma asked ("best": the fixed window the prediction finds best, resolved in predict.py); a parallel method
at batch 1 on a rank and on threads, over a batch drafting in turns (the engine's local drafter) or, written
METHOD:pipelined, beside the target; TABED over a batch only pipelined, as it runs.
What the draft sees is a `DraftKey`: the measurement prefills and scores each key once per item (measure.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from vpsd.bench.methods import BenchRun
from vpsd.config import RunConfig
from vpsd.pipeline.methods import METHODS, DraftPlace, get_method
from vpsd.pipeline.pruning.strategies import STRATEGIES

AUTO, BEST = "auto", "best"
VARIANTS = ("thread", "pipelined")


@dataclass(frozen=True)
class DraftKey:
    """What a draft is shown of an item, which decides its agreement with the target and its costs: `kind` chain (a
    draft model on the kept video tokens; trees draft from the same model), sparse_kv (std: the target on a top-K
    cache) or views (TABED); the pruning strategy and ratio; the signal layers a parallel method streams."""

    kind: str
    strategy: str
    ratio: float
    parallel: bool = False

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.strategy}@{self.ratio:g}" + ("/par" if self.parallel else "")


@dataclass(frozen=True)
class Candidate:
    method: str
    strategy: str  # "none" where the method prunes nothing
    ratio: float  # the share pruned (0 with "none"; std: its KV entries dropped per head)
    gamma: int | str  # a fixed window, "auto", or "best" until predict.py resolves it
    batch: int
    draft_on: str = "rank"
    pipelined: bool = False

    @property
    def label(self) -> str:
        m = get_method(self.method)
        text = self.method
        if m.uses_draft:
            text += f"+{self.strategy}" if self.strategy != m.default_strategy else ""
            text += f"@{self.ratio:g}" if self.ratio else ""
            text += "" if m.tree is not None else f" g={self.gamma}"
        text += ":thread" if self.draft_on == "thread" else ""
        text += ":pipelined" if self.pipelined else ""
        return f"{text} B={self.batch}"

    @property
    def place(self) -> DraftPlace:
        return get_method(self.method).draft_place(self.batch, self.pipelined, self.draft_on)

    @property
    def overlapped(self) -> bool:
        """Whether the draft drafts beside the target (Theorem 6's pipeline) rather than in turns with it."""
        return self.place in (DraftPlace.REMOTE, DraftPlace.THREADS)

    @property
    def nproc(self) -> int:
        """Ranks its job needs: the pipeline's three where the draft has a rank, else the target's alone."""
        return 3 if self.place is DraftPlace.REMOTE else 1

    def settings(self) -> dict:
        """The config keys that make this candidate (a tuned config's `settings`, launch/tuned.py); `ar` drafts
        nothing, so it leaves the config's pruning and window as they are."""
        if not get_method(self.method).uses_draft:
            return {"batching.size": self.batch}
        out = {"pruning.strategy": self.strategy, "pruning.ratio": self.ratio, "decoding.gamma": self.gamma,
               "batching.size": self.batch}
        if get_method(self.method).parallel:
            out["draft_on"] = self.draft_on
            out["batching.pipelined"] = self.pipelined
        return out

    def job(self) -> tuple[BenchRun, list[str]]:
        """The row and the options its job runs with (vpsd/bench/methods.py run_one)."""
        sets = [f"draft_on={self.draft_on}"] + (["batching.pipelined=true"] if self.pipelined else [])
        run = BenchRun(self.label.replace(" ", "_").replace("=", ""), self.method, self.strategy,
                       tuple(sets) if get_method(self.method).parallel else ())
        extra = ["--ratio", str(self.ratio), "--batch", str(self.batch)]
        if get_method(self.method).uses_draft:
            extra += ["--gamma", str(self.gamma)]
        return run, extra

    def draft_key(self, cfg: RunConfig) -> DraftKey | None:
        m = get_method(self.method)
        if not m.uses_draft:
            return None
        kind = {"pruned_input": "chain", "sparse_kv": "sparse_kv", "views": "views"}[m.draft]
        strategy = STRATEGIES[self.strategy]
        streams = cfg.pruning.signal_layers(True) != cfg.pruning.signal_layers(False)
        reads_signals = strategy.needs_attention or strategy.needs_hidden_states
        parallel = m.parallel and streams and reads_signals and self.ratio > 0 and kind != "sparse_kv"
        return DraftKey(kind, self.strategy, self.ratio, parallel)


def parse_methods(text: str | None) -> list[tuple[str, tuple[str, ...]]]:
    """`hippo,hippo:thread,tabed:pipelined` -> [(method, variants)]; ValueError naming what is unknown."""
    out = []
    for spec in (text.split(",") if text else list(METHODS)):
        name, _, rest = spec.strip().partition(":")
        variants = tuple(v for v in rest.split("+") if v)
        get_method(name)
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown variant {unknown[0]!r} of {name}; known: {', '.join(VARIANTS)}")
        out.append((name, variants))
    return out


@dataclass(frozen=True)
class GridSpec:
    methods: list[tuple[str, tuple[str, ...]]]
    strategies: list[str]  # run in the baseline method's pipeline
    ratios: list[float]
    gammas: list[int | str]  # ints, "auto", "best"
    placements: list[str]  # draft_on values a parallel method at batch 1 is tried with
    batches: list[int]
    baseline: str = "hippo"


def grid(spec: GridSpec) -> list[Candidate]:
    """Every candidate of `spec` (module docstring), `ar` first at each batch size, none twice."""
    out: dict[Candidate, None] = {}
    for batch in spec.batches:
        out[Candidate("ar", "none", 0.0, AUTO, batch)] = None
        for name, variants in spec.methods:
            for c in _method_candidates(spec, name, variants, batch):
                out[c] = None
    return list(out)


def _method_candidates(spec: GridSpec, name: str, variants: tuple[str, ...], batch: int) -> list[Candidate]:
    m = get_method(name)
    if not m.uses_draft:
        return []
    strategies = [m.default_strategy] + ([s for s in spec.strategies if s != m.default_strategy]
                                         if name == spec.baseline else [])
    prunes = m.default_ratio is None  # pearl, sd and sd-tree show the draft all of the video
    ratios = spec.ratios if prunes else [0.0]
    gammas = [AUTO] if m.tree is not None else spec.gammas
    out = []
    for place in _placements(spec, m, variants, batch):
        for s in strategies:
            for r in ratios:
                for g in gammas:
                    c = Candidate(name, s, 0.0 if s == "none" and m.draft != "sparse_kv" else r, g, batch, *place)
                    out.append(c)
    return out


def _placements(spec: GridSpec, m, variants: tuple[str, ...], batch: int) -> list[tuple[str, bool]]:
    """(draft_on, pipelined) pairs a method runs with at `batch`: its variants as written, else every placement
    at batch 1 and drafting in turns over a batch (TABED: beside the target, the only way it batches)."""
    if not m.parallel:
        return [("rank", False)]
    if variants:
        return [("thread" if "thread" in variants else "rank", "pipelined" in variants and batch > 1)]
    if batch == 1:
        return [(p, False) for p in spec.placements]
    return [("rank", m.draft == "views")]
