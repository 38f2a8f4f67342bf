"""The sample a tune runs on, and the grid its options ask for.

`sample_items`: N items of the manifest, spread evenly over it (or its first N). `write_samples`: the sample as a
manifest of its own for the confirming jobs at each batch size, with at least B items at batch B (more of the
manifest's items spread over it, or the sample repeated under new ids, as `vpsd bench throughput --tile` does), so
a batch fills; video paths absolute, so the file may lie anywhere.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vpsd.bench.tune.candidates import AUTO, BEST, GridSpec, parse_methods
from vpsd.config import RunConfig
from vpsd.launch.manifest import ManifestItem, load_manifest
from vpsd.pipeline.pruning.strategies import STRATEGIES


def _spread(count: int, n: int) -> list[int]:
    if n >= count:
        return list(range(count))
    return sorted({round(i * (count - 1) / (n - 1)) for i in range(n)}) if n > 1 else [0]


def sample_items(manifest: Path, n: int, first: bool = False) -> list[ManifestItem]:
    items, problems = load_manifest(manifest)
    if problems:
        raise ValueError(f"{manifest}: " + "; ".join(f"line {q.line}: {q.message}" for q in problems[:5]))
    if not items:
        raise ValueError(f"{manifest}: no items")
    return items[:n] if first else [items[i] for i in _spread(len(items), n)]


def write_samples(manifest: Path, sample: list[ManifestItem], batches: list[int], work: Path) -> dict[int, Path]:
    """{B: the manifest of the jobs at B}: the sample, grown to B items where it has fewer (module docstring)."""
    lines = manifest.read_bytes().split(b"\n")  # numbered as load_manifest numbers them
    raw = {i: json.loads(line) for i, line in enumerate(lines, start=1) if line.strip()}
    items, _ = load_manifest(manifest)

    def row(it: ManifestItem, suffix: str = "") -> dict:
        return {**raw[it.line], "id": f"{it.id}{suffix}", "video": str(it.video)}

    out = {}
    for b in sorted(set(batches)):
        rows = [row(it) for it in sample]
        if len(rows) < b:
            chosen = {it.id for it in sample}
            more = [items[i] for i in _spread(len(items), b) if items[i].id not in chosen]
            rows += [row(it) for it in more[: b - len(rows)]]
        k = 1
        while len(rows) < b:
            rows += [row(it, f"#{k}") for it in sample][: b - len(rows)]
            k += 1
        path = work / f"sample_b{b}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[b] = path
    return out


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def grid_spec(a: argparse.Namespace, cfg: RunConfig) -> GridSpec:
    """The grid `vpsd tune`'s options ask for (ValueError naming what is unknown)."""
    strategies = [s for s in (a.strategies.split(",") if a.strategies else STRATEGIES) if s]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown pruning strategy {unknown[0]!r}; known: {', '.join(sorted(STRATEGIES))}")
    ratios = _floats(a.ratios) if a.ratios else sorted({0.75, cfg.pruning.ratio, 0.95})
    if not ratios or not all(0.0 <= r < 1.0 for r in ratios):
        raise ValueError(f"--ratios must be in [0, 1), got {a.ratios}")
    gammas: list[int | str] = []
    for g in (v.strip() for v in a.gammas.split(",") if v.strip()):
        if g in (AUTO, BEST):
            gammas.append(g)
        elif g.isdigit() and int(g) >= 1:
            gammas.append(int(g))
        else:
            raise ValueError(f"--gammas takes auto, best or ints >= 1, got {g!r}")
    placements = [v for v in a.placements.split(",") if v]
    if not placements or set(placements) - {"rank", "thread"}:
        raise ValueError(f"--placements takes rank and thread, got {a.placements!r}")
    return GridSpec(parse_methods(a.methods), strategies, ratios, gammas, placements, list(a.batch),
                    a.baseline_method)
