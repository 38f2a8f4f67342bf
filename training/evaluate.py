"""Held-out evaluation of a world-trained pair: caption accuracy of each model and the draft's agreement.
(`--kind long`: the long world's pair, training/evaluate_long.py.)

Contract:
- `python -m training.evaluate --config configs/world_qwen2_5_vl.yaml --count N` writes N held-out videos
  (seeds from `HELD_OUT_SEEDS`, never trained on) as mp4, reads them back through the real decode path,
  and reports for the target and the draft alone: exact-match rate and mean word accuracy against the
  generated reference caption; then for serial speculative decoding with the draft: mean accepted tokens
  (MAT, bonus token included) and acceptance rate, without pruning and with the config's strategy, each
  checked token-for-token against the target's own greedy output.
- Word accuracy = 1 - (word-level edit distance / reference length), floored at 0.
- Part accuracy: the share of items whose caption gets a whole part right (`caption_parts`): the scene
  sentence (count, texture, background), the sentences of the objects seen from the start, the event.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from vpsd.config import PruningConfig, RunConfig, load_config, parse_overrides
from vpsd.decoders.ar import decode_ar
from vpsd.engine.keep import keep_policy_for
from vpsd.decoders.sd import decode_sd
from vpsd.models.registry import load_adapter, load_draft
from vpsd.tracing import configure_tracing
from vpsd.video.item import load_item_frames
from vpsd.world.caption import words
from vpsd.world.dataset import write_manifest
from training.world_short import HELD_OUT_SEEDS


def word_accuracy(hypothesis: str, reference: str) -> float:
    hyp, ref = words(hypothesis), words(reference)
    # Levenshtein distance over words, one row at a time.
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return max(0.0, 1.0 - row[-1] / max(1, len(ref)))


def caption_parts(text: str) -> dict[str, list[str]]:
    """The grammar's parts of a caption (vpsd.world.caption): scene sentence, object sentences, events."""
    sentences = [s.strip() for s in text.split(".") if s.strip()]
    return {
        "scene": sentences[:1],
        "objects": [s for s in sentences[1:] if not s.startswith("then ")],
        "event": [s for s in sentences[1:] if s.startswith("then ")],
    }


def parts_right(hypothesis: str, reference: str) -> dict[str, bool]:
    hyp, ref = caption_parts(hypothesis), caption_parts(reference)
    return {part: hyp[part] == ref[part] for part in ref}


def evaluate(cfg: RunConfig, workdir: Path, count: int, seeds: range = HELD_OUT_SEEDS) -> dict:
    manifest = write_manifest(workdir, list(seeds)[:count], max_new_tokens=cfg.decoding.max_new_tokens)
    items = [json.loads(line) for line in manifest.read_text().splitlines()]
    target = load_adapter(cfg.family, cfg.target)
    draft = load_draft(cfg.family, cfg.draft, target)
    greedy = replace(cfg.decoding, temperature=0.0)
    settings = {"unpruned": PruningConfig(strategy="none", ratio=0.0), cfg.pruning.strategy: cfg.pruning}
    rows = []
    for item in items:
        frames, times = load_item_frames(workdir / item["video"], cfg.video.num_frames, cfg.video.fps, cfg.video.max_side)
        row = {"id": item["id"], "reference": item["reference"]}
        reference_ids = None
        for name, model in (("target", target), ("draft", draft)):
            out = decode_ar(model, frames, item["prompt"], greedy, times)
            text = model.tokenizer.decode(out.token_ids, skip_special_tokens=True).strip()
            row[name] = {"caption": text, "exact": text == item["reference"],
                         "word_accuracy": word_accuracy(text, item["reference"]),
                         "parts": parts_right(text, item["reference"])}
            if name == "target":
                reference_ids = out.token_ids
        for label, pruning in settings.items():
            res = decode_sd(target, draft, frames, item["prompt"], greedy, keep_policy_for(pruning, target.family), pruning, times)
            if res.token_ids != reference_ids:
                raise AssertionError(f"speculative output differs from the target's on {item['id']} ({label})")
            row[f"sd_{label}"] = {"mat": res.stats.mean_accepted_tokens, "acceptance": res.stats.acceptance_rate}
        rows.append(row)
    return {"items": rows, "summary": summarize(rows, list(settings))}


def summarize(rows: list[dict], settings: list[str]) -> dict:
    out: dict = {"count": len(rows)}
    for name in ("target", "draft"):
        out[name] = {
            "exact_match": statistics.mean(r[name]["exact"] for r in rows),
            "word_accuracy": statistics.mean(r[name]["word_accuracy"] for r in rows),
            "parts": {part: statistics.mean(r[name]["parts"][part] for r in rows) for part in rows[0][name]["parts"]},
        }
    for label in settings:
        out[f"sd_{label}"] = {
            "mat": statistics.mean(r[f"sd_{label}"]["mat"] for r in rows),
            "acceptance": statistics.mean(r[f"sd_{label}"]["acceptance"] for r in rows),
        }
    return out


def print_short(s: dict) -> None:
    print(f"held-out items: {s['count']}")
    for name in ("target", "draft"):
        parts = "  ".join(f"{k} {v:.0%}" for k, v in s[name]["parts"].items())
        print(f"{name:>7}: exact match {s[name]['exact_match']:.0%}   word accuracy {s[name]['word_accuracy']:.1%}"
              f"   parts right: {parts}")
    for key, v in s.items():
        if key.startswith("sd_"):
            print(f"{key:>14}: MAT {v['mat']:.2f}   acceptance {v['acceptance']:.1%}   (outputs identical to the target's)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=("short", "long"), default="short", help="which world's pair and items")
    p.add_argument("--config", help="default: configs/world_qwen2_5_vl.yaml, or world_long_qwen2_5_vl.yaml for long")
    p.add_argument("--count", type=int, default=50)
    p.add_argument("--workdir", type=Path, help="where the held-out videos are written (default runs/world_eval[_long])")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, e.g. target.path=DIR")
    p.add_argument("--json", type=Path, help="write items and summary here")
    a = p.parse_args(argv)
    long = a.kind == "long"
    config = a.config or f"configs/world_{'long_' if long else ''}qwen2_5_vl.yaml"
    workdir = a.workdir or Path(f"runs/world_eval{'_long' if long else ''}")
    cfg = load_config(config, parse_overrides(a.set))
    configure_tracing(None, "evaluate", 0)  # spans of the decoders are trace data, not console output
    if long:
        from training.evaluate_long import evaluate_long, print_long

        report = evaluate_long(cfg, workdir, a.count)
        print_long(report["summary"])
    else:
        report = evaluate(cfg, workdir, a.count)
        print_short(report["summary"])
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
