"""Distils the long-world draft toward the long-world target: the second stage of the long pair's recipe.

    python -m training.distill_long --out checkpoints/world_long_qwen2_5_vl      # resumes if OUT/distill/ exists

Why. Speculative decoding's speed is the draft's agreement with the *target's own output*, not with the reference
caption. The first stage (training/world_long.py) trained both models on the world's captions; the target then
writes captions that state the scene right and the events plausibly but not as shown (docs/worlds.md), and the
draft, trained on the same references, guesses its own plausible events: the pair agrees on ~56% of drafted
tokens (MAT ~3.2 at gamma 4). DistillSpec (Zhou et al., 2023) aligns a draft with its target by distillation on
the target's own generations; for greedy verification the forward KL from the target's distribution works well,
and it is what this stage does:
- each example is a training-seed video through the real path (mp4 round trip, PyAV decode at the config's
  sampling, the adapters' prompt, towers and positions: vpsd.models, the code decoding runs);
- the target prefills all of it and decodes greedily, exactly as `ar` does; its logits at every answer position
  are the teacher;
- the draft sees the video the way the pipeline will show it: 40% of examples keep the 10% HIPPO keeps (the
  config's strategy with the target's streamed attention, as in a parallel run), 15% a random 5-50%, 10% a
  uniform 10%, the rest all of it; kept tokens at their original rotary positions;
- the loss is KL(target || draft) over the answer's positions (the draft's next-token distribution at the
  prompt's end and after each committed token), the draft's language model trained, its tower frozen.
The target is not changed: every output of the pair stays the target's (lossless either way); only agreement moves.

Resumable: every `save_every` steps OUT/distill/state.pt holds the draft, its optimizer and the step; the data is
a function of the step. Seeds come from [0, LONG_HELD_OUT_FROM), a different stride from the first stage's.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from vpsd.config import PruningConfig, RunConfig, load_config, parse_overrides
from vpsd.engine.keep import keep_policy_for
from vpsd.models.base import SequenceEmbeddings
from vpsd.models.registry import load_adapter, load_draft
from vpsd.engine.pair_prefill import prefill_for_strategy
from vpsd.pipeline.pruning.select import random_keep, uniform_keep
from vpsd.video.item import load_item_frames
from vpsd.world.dataset import LONG_HELD_OUT_FROM, LONG_MAX_NEW_TOKENS, make_long_example, write_video
from vpsd.world.long_scene import FPS

CONFIG = "configs/world_long_qwen2_5_vl.yaml"


@dataclass
class DistillConfig:
    steps: int = 300
    batch_size: int = 8  # examples per optimizer step (accumulated one at a time)
    lr: float = 3e-4  # a fine-tune of a trained draft: a third of the first stage's
    warmup: int = 10
    weight_decay: float = 0.01
    seed: int = 1
    # The draft's view of the video (the rest: all of it).
    keep_hippo: float = 0.40  # the config's strategy (HIPPO at 90%) on the target's own signals
    keep_random: float = 0.15
    keep_uniform: float = 0.10
    random_keep_range: tuple[float, float] = (0.05, 0.5)
    log_every: int = 5
    save_every: int = 10
    threads: int = 1


@dataclass
class Clip:
    seed: int
    t_emb: SequenceEmbeddings  # the target's view of the whole video (its tower's features in place)
    d_emb: SequenceEmbeddings  # the draft's
    max_new_tokens: int


@contextmanager
def distinct_groups_only(model):
    """Within the block, `model`'s Qwen2.5-VL tower runs on each distinct temporal group once and copies the
    features where a group repeats. Exact up to float noise: the tower sees each temporal group on its own (its
    window and full attention stay inside a group, its rotary phase is 2-D), and a long-world video is mostly
    stills, so this is 3-8x less tower work (training/world_long.py does the same)."""
    inner = model.model
    original = inner.get_video_features

    def features(pixel_values_videos, video_grid_thw, **kwargs):
        (t, h, w), = video_grid_thw.tolist()
        groups = pixel_values_videos.view(t, h * w, -1)
        first: dict[bytes, int] = {}
        which = [first.setdefault(g.numpy().tobytes(), len(first)) for g in groups]
        unique = [which.index(i) for i in range(len(first))]
        out = original(groups[unique].reshape(-1, groups.shape[-1]),
                       torch.tensor([[len(unique), h, w]], device=video_grid_thw.device), **kwargs)
        per_group = torch.cat(list(out.pooler_output)).view(len(unique), -1, out.pooler_output[0].shape[-1])
        out.pooler_output = [per_group[torch.tensor(which)].reshape(-1, per_group.shape[-1])]
        return out

    inner.get_video_features = features
    try:
        yield
    finally:
        inner.get_video_features = original


class ClipStream(torch.utils.data.IterableDataset):
    """One list of `Clip`s per optimizer step from `first_step` on, made in a DataLoader worker (the other core):
    rendered, round-tripped through an mp4, read back at the run config's sampling, and embedded by both
    models' towers (frozen: the training process runs language models only)."""

    def __init__(self, cfg: DistillConfig, run: RunConfig, first_step: int):
        self.cfg, self.run, self.first_step = cfg, run, first_step

    def seed(self, step: int, i: int) -> int:
        n = step * self.cfg.batch_size + i + self.cfg.seed * 7_777
        return (n * 6_151 + 29) % LONG_HELD_OUT_FROM

    @torch.inference_mode()
    def __iter__(self):
        torch.set_num_threads(1)
        target = load_adapter(self.run.family, self.run.target)
        draft = load_draft(self.run.family, self.run.draft, target)
        v = self.run.video
        with tempfile.TemporaryDirectory() as tmp, distinct_groups_only(target.model), \
                distinct_groups_only(draft.model):
            for step in range(self.first_step, self.cfg.steps):
                clips = []
                for i in range(self.cfg.batch_size):
                    seed = self.seed(step, i)
                    ex = make_long_example(seed)
                    path = Path(tmp) / f"{seed}.mp4"
                    write_video(path, ex.frames, FPS)
                    frames, times = load_item_frames(path, v.num_frames, v.fps, v.max_side)
                    path.unlink()
                    t_emb = target.embed(target.prepare(frames, ex.prompt, times))
                    d_emb = draft.embed(draft.prepare(frames, ex.prompt, times))
                    clips.append(Clip(seed, t_emb, d_emb, LONG_MAX_NEW_TOKENS[ex.kind]))  # as the manifests
                yield clips


@torch.inference_mode()
def teacher(target, clip: Clip, pruning: PruningConfig):
    """The target's greedy answer to `clip` (as `ar` decodes it), its logits before each answer token (n, V), and
    its prefill (for the keep policy's signals)."""
    emb = clip.t_emb
    pre = prefill_for_strategy(target, emb, pruning, parallel=True)
    eos = set(target.eos_token_ids)
    logits, rows, tokens = pre.logits, [], []
    while True:
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        if tokens[-1] in eos or len(tokens) == clip.max_new_tokens:
            break
        logits = target.step(pre.state, torch.tensor([tokens[-1]]))[-1]
    return emb, pre, tokens, torch.stack(rows)


def draft_view(cfg: DistillConfig, clip: Clip, policy, t_emb, t_pre, d_emb) -> tuple[str, torch.Tensor | None]:
    rng = random.Random(clip.seed * 17 + 3)
    u = rng.random()
    if u < cfg.keep_hippo:
        return "hippo", policy(t_emb, t_pre, d_emb)
    u -= cfg.keep_hippo
    if u < cfg.keep_random:
        return "random", random_keep(t_emb.layout, 1 - rng.uniform(*cfg.random_keep_range), clip.seed)
    u -= cfg.keep_random
    if u < cfg.keep_uniform:
        return "uniform", uniform_keep(t_emb.layout, 0.9)
    return "all", None


def draft_logits(draft, d_emb, keep: torch.Tensor | None, tokens: list[int]) -> torch.Tensor:
    """(n, V) the draft's logits before each of the target's n answer tokens, with gradients: its kept prompt
    (prefill positions as `VideoLMAdapter.prefill` feeds them) then the answer, one forward."""
    sel = draft.kept_sequence_positions(d_emb.layout, d_emb.seq_len, keep)
    prompt = d_emb.embeds[:, sel]
    answer_ids = torch.tensor(tokens[:-1]).view(1, -1)
    embeds = torch.cat([prompt, draft.model.get_input_embeddings()(answer_ids)], dim=1)
    answer_pos = (d_emb.next_position + torch.arange(answer_ids.shape[1])).view(1, 1, -1)
    positions = torch.cat([d_emb.positions[:, :, sel], answer_pos.expand(d_emb.positions.shape[0], 1, -1)], dim=2)
    out = draft.language_model(inputs_embeds=embeds, position_ids=positions, use_cache=False)
    return draft.model.lm_head(out.last_hidden_state[0, prompt.shape[1] - 1 :]).float()


def lr_at(step: int, cfg: DistillConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def distill(run: RunConfig, out: Path, cfg: DistillConfig) -> dict:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    target = load_adapter(run.family, run.target)
    draft = load_draft(run.family, run.draft, target)
    model = draft.model
    for p in model.model.visual.parameters():
        p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    policy = keep_policy_for(run.pruning, run.family)
    resume = out / "distill" / "state.pt"
    start, history, elapsed = 0, [], 0.0
    if resume.exists():
        state = torch.load(resume, weights_only=False)
        model.load_state_dict(state["draft"])
        opt.load_state_dict(state["opt"])
        start, history, elapsed = state["step"], state["history"], state["elapsed"]
        print(f"resuming at step {start} of {cfg.steps} ({elapsed / 60:.1f} min distilled)", flush=True)
    loader = torch.utils.data.DataLoader(ClipStream(cfg, run, start), batch_size=None, num_workers=1,
                                         prefetch_factor=2)
    t0 = time.time() - elapsed
    progress = tqdm(loader, initial=start, total=cfg.steps, unit="step", disable=None, mininterval=30)
    for step, clips in enumerate(progress, start):
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        row: dict = {"step": step, "lr": lr, "kl": [], "agree": [], "view": []}
        for clip in clips:
            t_emb, t_pre, tokens, t_logits = teacher(target, clip, run.pruning)
            d_emb = clip.d_emb
            view, keep = draft_view(cfg, clip, policy, t_emb, t_pre, d_emb)
            d_emb = replace(d_emb, embeds=d_emb.embeds.clone())  # out of inference mode: autograd may save it
            model.train()
            logits = draft_logits(draft, d_emb, keep, tokens)
            teacher_logp = F.log_softmax(t_logits.clone(), -1)
            kl = F.kl_div(F.log_softmax(logits, -1), teacher_logp, log_target=True, reduction="batchmean")
            (kl / len(clips)).backward()
            model.eval()
            row["kl"].append(kl.item())
            row["agree"].append((logits.argmax(-1) == torch.tensor(tokens)).float().mean().item())
            row["view"].append(view)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        row["kl"], row["agree"] = float(np.mean(row["kl"])), float(np.mean(row["agree"]))
        history.append(row)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            el = time.time() - t0
            progress.write(f"step {step:4d}  kl {row['kl']:.3f}  argmax agreement {row['agree']:.3f}  lr {lr:.1e}  "
                           f"{el / (step + 1):.1f} s/step  {el / 60:.1f} min")
        if (step + 1) % cfg.save_every == 0 or step == cfg.steps - 1:
            save_resume(resume, model, opt, step + 1, history, time.time() - t0)
    meta = {"config": asdict(cfg), "seconds": time.time() - t0, "final": history[-1] if history else None}
    return meta, model, history


def save_resume(path: Path, model, opt, step: int, history: list, elapsed: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"draft": model.state_dict(), "opt": opt.state_dict(), "step": step, "history": history,
                "elapsed": elapsed}, tmp)
    tmp.replace(path)  # a run killed mid-write keeps the previous state


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the pair's directory: OUT/draft is replaced at the end")
    p.add_argument("--config", default=CONFIG, help="the pair, its video sampling and its pruning")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=DistillConfig.steps)
    p.add_argument("--batch-size", type=int, default=DistillConfig.batch_size)
    p.add_argument("--lr", type=float, default=DistillConfig.lr)
    p.add_argument("--threads", type=int, default=DistillConfig.threads)
    a = p.parse_args(argv)
    out = a.out.resolve()
    sets = [f"target.path={out / 'target'}", f"draft.path={out / 'draft'}", *a.set]
    run = load_config(a.config, parse_overrides(sets))
    cfg = DistillConfig(steps=a.steps, batch_size=a.batch_size, lr=a.lr, threads=a.threads)
    meta, model, history = distill(run, out, cfg)
    # Only the weights change: the draft's tokenizer, chat template and video settings stay as they are.
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}  # on disk as the pair's
    model.save_pretrained(out / "draft", state_dict=state, safe_serialization=True)
    (out / "distill_log.json").write_text(json.dumps({"meta": meta, "history": history}))
    print(f"distilled in {meta['seconds'] / 60:.1f} min; wrote {out}/draft")


if __name__ == "__main__":
    main()
