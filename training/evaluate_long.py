"""Held-out evaluation of the long-world pair: quality per prompt kind, next to a blind baseline, and the draft's
agreement with the target at 0% and 90% pruning.

    python -m training.evaluate --kind long --config configs/world_long_qwen2_5_vl.yaml --count 100

Items are long-world seeds from LONG_HELD_OUT_FROM on (never trained or tuned on), written as mp4 and read back
through the real decode path at the config's sampling. Per item, greedy:
- the target, the draft, and the target shown a blank video of the same length (the blind baseline: what the
  prompt and the grammar alone give, so what the target gains over it is what it reads from the video);
- serial speculative decoding with the draft, unpruned and at the config's strategy and ratio, each checked
  token for token against the target's own output; its MAT (tokens per verification, bonus included).
Per prompt kind:
- captions: word accuracy (1 - word edit distance / reference length), exact match, and per reference event
  sentence ("at 12 seconds the red circle turns green."): whether the caption holds it exactly, and whether it
  holds the event's clause at all (then: with the right time?);
- questions: exact answer.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from training.evaluate import word_accuracy
from vpsd.config import PruningConfig, RunConfig
from vpsd.decoders.ar import decode_ar
from vpsd.engine.keep import keep_policy_for
from vpsd.decoders.sd import decode_sd
from vpsd.models.registry import load_adapter, load_draft
from vpsd.video.item import load_item_frames
from vpsd.world.dataset import LONG_HELD_OUT_FROM, write_long_manifest


def event_sentences(caption: str) -> dict[str, str]:
    """{clause: time} of a caption's event sentences ("at 12 seconds the red circle turns green")."""
    out = {}
    for s in (s.strip() for s in caption.split(".")):
        words = s.split()
        if len(words) > 3 and words[0] == "at" and words[1].isdigit() and words[2] in ("second", "seconds"):
            out[" ".join(words[3:])] = words[1]
    return out


def caption_scores(hypothesis: str, reference: str) -> dict[str, float]:
    ref, hyp = event_sentences(reference), event_sentences(hypothesis)
    named = [c for c in ref if c in hyp]
    return {
        "word_accuracy": word_accuracy(hypothesis, reference),
        "exact": float(hypothesis == reference),
        "events_right": sum(hyp.get(c) == t for c, t in ref.items()) / max(1, len(ref)),
        "events_named": len(named) / max(1, len(ref)),
        "times_right_when_named": (sum(hyp[c] == ref[c] for c in named) / len(named)) if named else float("nan"),
    }


def scores(kind: str, hypothesis: str, reference: str) -> dict[str, float]:
    if kind == "question":
        return {"exact": float(hypothesis.strip() == reference.strip())}
    return caption_scores(hypothesis, reference)


def evaluate_long(cfg: RunConfig, workdir: Path, count: int) -> dict:
    manifest = write_long_manifest(workdir, range(LONG_HELD_OUT_FROM, LONG_HELD_OUT_FROM + count))
    items = [json.loads(line) for line in manifest.read_text().splitlines()]
    target = load_adapter(cfg.family, cfg.target)
    draft = load_draft(cfg.family, cfg.draft, target)
    settings = {"unpruned": PruningConfig(strategy="none", ratio=0.0), cfg.pruning.strategy: cfg.pruning}
    rows = []
    for item in tqdm(items, unit="item", disable=None):
        frames, times = load_item_frames(workdir / item["video"], cfg.video.num_frames, cfg.video.fps, cfg.video.max_side)
        dec = replace(cfg.decoding, temperature=0.0, max_new_tokens=item["max_new_tokens"])
        row = {"id": item["id"], "kind": item["kind"], "reference": item["reference"]}
        target_ids = None
        shown = {"target": (target, frames), "draft": (draft, frames), "blind": (target, np.zeros_like(frames))}
        for name, (model, video) in shown.items():
            out = decode_ar(model, video, item["prompt"], dec, times)
            text = model.tokenizer.decode(out.token_ids, skip_special_tokens=True).strip()
            row[name] = {"text": text, **scores(item["kind"], text, item["reference"])}
            if name == "target":
                target_ids = out.token_ids
        for label, pruning in settings.items():
            res = decode_sd(target, draft, frames, item["prompt"], dec, keep_policy_for(pruning, target.family),
                            pruning, times)
            if res.token_ids != target_ids:
                raise AssertionError(f"speculative output differs from the target's on {item['id']} ({label})")
            row[f"sd_{label}"] = {"mat": res.stats.mean_accepted_tokens, "acceptance": res.stats.acceptance_rate,
                                  "num_kept": res.num_kept, "num_video_tokens": res.num_video_tokens}
        rows.append(row)
    return {"items": rows, "summary": summarize_long(rows, list(settings))}


def _mean(xs) -> float:
    xs = [x for x in xs if x == x]  # NaN: not applicable to that item
    return statistics.mean(xs) if xs else float("nan")


def summarize_long(rows: list[dict], settings: list[str]) -> dict:
    out: dict = {"count": len(rows)}
    for kind in ("caption", "question"):
        of_kind = [r for r in rows if r["kind"] == kind]
        out[kind] = {"count": len(of_kind)}
        for name in ("target", "draft", "blind"):
            metrics = of_kind[0][name].keys() - {"text"} if of_kind else []
            out[kind][name] = {m: _mean(r[name][m] for r in of_kind) for m in sorted(metrics)}
    for label in settings:
        out[f"sd_{label}"] = {k: _mean(r[f"sd_{label}"][k] for r in rows) for k in ("mat", "acceptance", "num_kept")}
    return out


def print_long(summary: dict) -> None:
    print(f"held-out long items: {summary['count']}")
    for kind in ("caption", "question"):
        s = summary[kind]
        print(f"{kind}s ({s['count']}):")
        for name in ("target", "draft", "blind"):
            print(f"  {name:>7}: " + "   ".join(f"{k} {v:.1%}" for k, v in s[name].items()))
    for key, v in summary.items():
        if key.startswith("sd_"):
            print(f"{key:>14}: MAT {v['mat']:.2f}   acceptance {v['acceptance']:.1%}   video tokens kept "
                  f"{v['num_kept']:.0f}   (outputs identical to the target's)")
