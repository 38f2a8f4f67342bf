"""`vpsd bench steps`: what a decode step and a verify cost eager and captured, side by side.

    vpsd bench steps --config C --manifest M [--set KEY=VALUE ...] [--mode cudagraphs]
                     [--widths 1,8] [--steps 16] [--repeats 5] [--json OUT] [--profile]

The terms of App. C that captured steps (models/captured.py) move: the target's step T_p and the draft's T_q,
hence their ratio c = T_p / T_q, which on a GPU an eager step's launch overhead squeezes toward the ratio of
layer counts. One item of the manifest is prefilled by each model of the config (the target on all of its video,
the draft on `--draft-keep` of it, spread evenly, as a pruning draft sees it); then, for each width k, `--steps`
forwards of k tokens are timed eagerly and captured (the same model, the same weights; the captured ones over a
copy of the prefill in the fixed cache), rolled back after each run, the two interleaved `--repeats` times after a
warm-up that compiles the graphs. Medians and the spread (max - min over median) a forward, the speedup, and the
largest logit difference between the two paths at each width (float noise; greedy identity is the tests').

`--profile` instead splits each eager forward into kernels, launches and host waits and counts its aten ops and
host reads against transformers' own generate() step (bench/step_profile.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vpsd.config import load_config, parse_overrides
from vpsd.launch.manifest import load_manifest
from vpsd.models.base import DecodeState, VideoLMAdapter
from vpsd.models.captured import held_entries
from vpsd.models.registry import load_adapter, load_draft
from vpsd.bench.step_profile import StepProfile, format_profiles, profile_steps
from vpsd.models.timing import settled_clock
from vpsd.video.item import load_item_frames

TOKEN = 11  # the token fed at every step: its value changes no cost, and the logits compared are the same rows


@dataclass
class Cost:
    model: str
    width: int
    context: int
    eager_ms: float
    eager_spread: float
    captured_ms: float
    captured_spread: float
    max_logit_diff: float

    @property
    def speedup(self) -> float:
        return self.eager_ms / self.captured_ms


def _timed(adapter: VideoLMAdapter, state: DecodeState, width: int, steps: int) -> float:
    """Seconds a forward of `width` tokens, over `steps` of them; the state rolled back after."""
    start = state.length
    ids = torch.full((width,), TOKEN, dtype=torch.long)
    t0 = settled_clock(adapter.device)
    for _ in range(steps):
        adapter.step(state, ids)
    t1 = settled_clock(adapter.device)
    adapter.rollback(state, start)
    return (t1 - t0) / steps


def measure(name: str, adapter: VideoLMAdapter, state: DecodeState, widths: list[int], steps: int,
            repeats: int) -> list[Cost]:
    """`state` (a prefill's, eager) against its copy in `adapter`'s fixed cache, width by width."""
    fixed = adapter.fixed_cache.take(measure, held_entries(state.cache), max(widths) * steps)
    if fixed is None:
        raise ValueError(f"{name}: a prefill of {state.length} + {max(widths) * steps} steps do not fit "
                         f"capture_len {adapter.fixed_cache.capacity}")
    captured = DecodeState(cache=fixed, position_offset=state.position_offset, prefill_len=state.prefill_len)
    out = []
    for k in widths:
        ids = torch.full((k,), TOKEN, dtype=torch.long)
        diff = float((adapter.step(state, ids) - adapter.step(captured, ids)).abs().max())  # also compiles
        adapter.rollback(state, state.prefill_len)
        adapter.rollback(captured, captured.prefill_len)
        _timed(adapter, captured, k, 2)  # warm: a graph's first runs record it
        eager, comp = [], []
        for _ in range(repeats):  # interleaved: whatever else the machine does hits both alike
            eager.append(_timed(adapter, state, k, steps))
            comp.append(_timed(adapter, captured, k, steps))
        e, c = statistics.median(eager), statistics.median(comp)
        out.append(Cost(name, k, state.length, 1e3 * e, (max(eager) - min(eager)) / e, 1e3 * c,
                        (max(comp) - min(comp)) / c, diff))
    adapter.fixed_cache.give_back(measure)
    return out


def format_table(costs: list[Cost]) -> str:
    lines = ["model   width  context   eager ms (spread)   captured ms (spread)   speedup   max |logit diff|"]
    for c in costs:
        lines.append(f"{c.model:<7} {c.width:>5} {c.context:>8} {c.eager_ms:>10.2f} ({c.eager_spread:5.1%})"
                     f" {c.captured_ms:>12.2f} ({c.captured_spread:5.1%}) {c.speedup:>8.2f}x {c.max_logit_diff:>12.3g}")
    by = {(c.model, c.width): c for c in costs}
    if ("target", 1) in by and ("draft", 1) in by:
        t, d = by["target", 1], by["draft", 1]
        lines.append(f"c = T_p / T_q (one-token steps): eager {t.eager_ms / d.eager_ms:.2f}, "
                     f"captured {t.captured_ms / d.captured_ms:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpsd bench steps",
                                description="a step's and a verify's cost, eager and captured, side by side")
    p.add_argument("--config", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE config overrides")
    p.add_argument("--item", type=int, default=0, help="which manifest item to prefill (0: the first)")
    p.add_argument("--mode", default="cudagraphs", help="how steps are captured (models/spec.CAPTURE_MODES)")
    p.add_argument("--widths", default="1,8", help="tokens a forward: 1 is a decode step, gamma + 1 a verify")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--draft-keep", type=float, default=0.1, help="share of the video the draft is prefilled on")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--profile", action="store_true",
                   help="where an eager forward's time goes (kernels, launches, host waits) and its op count against "
                        "transformers' generate() step, instead of eager against captured")
    a = p.parse_args(argv)
    cfg = load_config(a.config, parse_overrides(a.set))
    widths = [int(w) for w in a.widths.split(",")]
    item = load_manifest(a.manifest)[0][a.item]
    frames, times = load_item_frames(item.video, item.num_frames or cfg.video.num_frames,
                                     item.fps or cfg.video.fps, cfg.video.max_side)
    target = load_adapter(cfg.family, cfg.target)
    models = [("target", target, None)]
    if cfg.draft is not None:
        models.append(("draft", load_draft(cfg.family, cfg.draft, target), a.draft_keep))
    costs: list[Cost] = []
    profiles: list[StepProfile] = []
    for name, adapter, keep_share in models:
        inputs = adapter.prepare(frames, item.prompt, times)
        emb = adapter.embed(inputs)
        keep = None
        if keep_share is not None:
            n = emb.layout.num_tokens
            keep = torch.linspace(0, n - 1, max(1, round(keep_share * n))).round().long().unique()
        state = adapter.prefill(emb, keep).state
        if a.profile:
            hf = {"input_ids": inputs.input_ids, **inputs.pixel_inputs} if keep is None else None
            profiles += [profile_steps(name, adapter, state, k, a.steps, hf) for k in widths]
            print(format_profiles([p for p in profiles if p.model == name]), flush=True)
            continue
        adapter.capture(a.mode, max(cfg.target.capture_len, state.length + max(widths) * a.steps))
        costs += measure(name, adapter, state, widths, a.steps, a.repeats)
        print(format_table([c for c in costs if c.model == name]), flush=True)
    if a.profile:
        print(f"\n{item.id} on {target.device}, {cfg.target.dtype}, eager\n{format_profiles(profiles)}")
        if a.json:
            a.json.write_text(json.dumps([asdict(p) for p in profiles], indent=1))
        return 0
    print(f"\n{item.id}: capture {a.mode} on {target.device}, {cfg.target.dtype}")
    print(format_table(costs))
    if a.json:
        a.json.write_text(json.dumps([asdict(c) | {"speedup": c.speedup} for c in costs], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
