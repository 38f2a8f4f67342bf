"""Trains the long-world pair (checkpoints/world_long_qwen2_5_vl) from the short world's trained pair, on CPU.

    python -m training.world_long --out checkpoints/world_long_qwen2_5_vl      # resumes if OUT/resume/ exists

What it trains, and why this way (the budget is 2.5 h of this repository's 2-core CPU):
- The long world (vpsd.world.long_scene) draws the same objects on the same 7-pixel lattice as the short one,
  so the short pair's vision towers already see them (colour, shape, size, motion per token). They are taken
  as they are, frozen with their mergers, and run in the data worker: the training process spends its core
  on the language models only, whose sequences are 1k-4k video tokens long.
- The language models start from the short pair's (token embeddings carried over by token string to the
  long world's tokenizer), so they start out knowing how the towers' features name objects, and learn what
  is new: many events, time stamps read from the rotary phase of the video tokens (Qwen2.5-VL puts each
  temporal group at its time in seconds x tokens_per_second), the dense grammar and the questions.
- The draft is the short draft made multi-head (its one KV head copied, an exact copy of its function) and
  two layers deeper (identity layers, vpsd.models.grow's rule), so its KV cache per token is large next to
  its weights: what it reads at a step grows with the video it was given, as a deployment's draft's does at
  long context, and pruning the video makes its steps cheaper, not only its prefill.
- Time stamps: a caption's "at 12 seconds" must be read from the rotary phase of the event's video tokens
  (Qwen2.5-VL places each temporal group at its time x tokens_per_second). A tiny model does not find that
  in the budget from the captions alone (its loss on the numbers stayed at chance), so an auxiliary loss
  asks its middle hidden state of every video token for that token's second (a linear head, not saved).
- Answer positions are the ones decoding uses (`answer_positions`), not get_rope_index's over the whole text.
- Every example is one forward (no padding: lengths vary 4x), gradients accumulated over `batch_size`.
- The draft also trains on pruned video at the ratios the strategies use: the 10% HIPPO keeps without the
  target's attention (temporal + spatial scores, z-fused per frame: `hippo_no_attn`), 10% spread uniformly,
  and random shares; kept tokens keep their original rotary positions, as a pruned prefill feeds them.
- Resumable: every `save_every` steps OUT/resume/state.pt holds both models, both optimizers and the step;
  the data is a function of the step, so a run cut off goes on where it stopped.
- Seeds: training draws from [0, LONG_HELD_OUT_FROM); held-out checks use seeds from LONG_HELD_OUT_FROM on.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from vpsd.models.prompt import PROMPT_SLOT, encode_chat
from vpsd.models.qwen2_5_vl import qwen_chat_prompt
from vpsd.models.qwen_video import QwenVisionSpec, qwen_video_tensors
from vpsd.models.tokenizer import build_tokenizer
from vpsd.pipeline.layout import VideoTokenLayout
from vpsd.pipeline.pruning.select import random_keep, uniform_keep
from vpsd.pipeline.pruning.strategies import STRATEGIES, PruningSignals
from vpsd.video.item import load_item_frames
from vpsd.world.dataset import LONG_HELD_OUT_FROM, make_long_example, write_video
from vpsd.world.long_caption import DENSE_PROMPTS, long_example_text
from vpsd.world.long_sampler import sample_long_scene
from vpsd.world.long_scene import DURATION_S, FPS

SHORT_PAIR = Path("checkpoints/world_qwen2_5_vl")
TOKENS_PER_SECOND = 4  # the short pair's vision config; the temporal position of group g is int(g * 0.5 * 4)
SECONDS_PER_GRID = 2 / FPS  # every frame sampled, two frames per temporal group
DRAFT_LAYERS = 4
PRUNE_RATIO = 0.9  # HIPPO's, ParallelVLM's and the configs' default


@dataclass
class TrainConfig:
    steps: int = 700  # 2.4 h at ~12.3 s a step on the 2-core machine (the budget: 2.5 h)
    batch_size: int = 8  # examples per optimizer step (accumulated one at a time)
    lr: float = 1e-3
    warmup: int = 30
    weight_decay: float = 0.01
    seed: int = 0
    # Draft keep policy shares (the rest: the whole video): hippo_no_attn at 90% pruning, uniform at 90%,
    # a random share kept in `random_keep_range`.
    draft_hippo: float = 0.35
    draft_uniform: float = 0.15
    draft_random: float = 0.2
    random_keep_range: tuple[float, float] = (0.05, 0.5)
    time_weight: float = 0.3  # the auxiliary time loss's weight (example_loss)
    log_every: int = 10
    save_every: int = 25
    threads: int = 1
    init: str = str(SHORT_PAIR)


# ---- tokenizer and models -------------------------------------------------------------------------------


def long_tokenizer():
    """A byte-level BPE whose corpus holds the long world's captions, questions and prompts."""
    corpus = list(DENSE_PROMPTS)
    for seed in range(0, 800 * 7, 7):
        prompt, answer, _ = long_example_text(sample_long_scene(seed), seed)
        corpus += [prompt, answer]
    corpus += [f"at {n} seconds" for n in range(64)] * 20
    return build_tokenizer(vocab_size=1024, extra_corpus=corpus)


def _carry_embeddings(new: torch.Tensor, old: torch.Tensor, new_tok, old_tok) -> int:
    """Copies the rows of tokens both vocabularies hold (same string); returns how many."""
    old_vocab = old_tok.get_vocab()
    n = 0
    for token, i in new_tok.get_vocab().items():
        j = old_vocab.get(token)
        if j is not None and i < new.shape[0] and j < old.shape[0]:
            new[i] = old[j]
            n += 1
    return n


def build_models(tokenizer, init: Path) -> dict[str, torch.nn.Module]:
    """The short pair, re-vocabularied for `tokenizer`; the draft made multi-head and DRAFT_LAYERS deep."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from vpsd.models.grow import grow_model
    from vpsd.models.qwen2_5_vl import qwen_token_ids

    models = {}
    for name in ("target", "draft"):
        src = Qwen2_5_VLForConditionalGeneration.from_pretrained(init / name, dtype=torch.float32)
        old_tok = AutoTokenizer.from_pretrained(init / name)
        if name == "draft":
            src = _multi_head(src)
            src = grow_model(src, 1, DRAFT_LAYERS)
        config = src.config
        config.text_config.vocab_size = len(tokenizer)
        for key, value in qwen_token_ids(tokenizer).items():
            setattr(config, key, value)
            if hasattr(config.text_config, key):
                setattr(config.text_config, key, value)
        config._attn_implementation = "sdpa"
        model = Qwen2_5_VLForConditionalGeneration(config)
        state = {k: v for k, v in src.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
        model.load_state_dict(state, strict=False)
        with torch.no_grad():
            emb, head = model.get_input_embeddings().weight, model.lm_head.weight
            emb.normal_(0, 0.02)
            head.normal_(0, 0.02)
            carried = _carry_embeddings(emb, src.get_input_embeddings().weight, tokenizer, old_tok)
            _carry_embeddings(head, src.lm_head.weight, tokenizer, old_tok)
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
              f"{carried} token rows carried from {init / name}", flush=True)
        models[name] = model
    return models


def _multi_head(model):
    """The same model with one KV head per query head (each a copy of the one its query head read)."""
    text = model.config.text_config
    groups = text.num_attention_heads // text.num_key_value_heads
    if groups == 1:
        return model
    d = text.head_dim
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            attn = layer.self_attn
            for proj in (attn.k_proj, attn.v_proj):
                w = proj.weight.view(text.num_key_value_heads, d, -1).repeat_interleave(groups, 0).reshape(-1, proj.in_features)
                b = proj.bias.view(text.num_key_value_heads, d).repeat_interleave(groups, 0).reshape(-1)
                new = torch.nn.Linear(proj.in_features, w.shape[0], bias=True)
                new.weight.copy_(w)
                new.bias.copy_(b)
                setattr(attn, "k_proj" if proj is attn.k_proj else "v_proj", new)
            attn.num_key_value_groups = 1
    text.num_key_value_heads = text.num_attention_heads
    return model


# ---- data -----------------------------------------------------------------------------------------------


@dataclass
class Example:
    ids: torch.Tensor  # (L,) prompt then answer
    labels: torch.Tensor  # (L,) -100 on the prompt
    positions: torch.Tensor  # (3, L) M-RoPE positions
    features: dict[str, torch.Tensor]  # model name -> (N, D) frozen tower output, one row per video token
    draft_keep: torch.Tensor | None  # kept video token indices for the draft (None: all)
    kind: str
    seconds: torch.Tensor  # (N,) the second each video token shows (the auxiliary time loss's labels)


class LongStream(torch.utils.data.IterableDataset):
    """Lists of `Example`s, one list per optimizer step, from `first_step` on; made in a DataLoader worker
    (render, mp4 round trip, the frozen towers), so the training process only runs language models."""

    def __init__(self, cfg: TrainConfig, models: dict, tokenizer, first_step: int):
        self.cfg, self.models, self.tokenizer, self.first_step = cfg, models, tokenizer, first_step
        vc = models["target"].config.vision_config
        self.spec = QwenVisionSpec(patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                                   temporal_patch_size=vc.temporal_patch_size)

    def __iter__(self):
        torch.set_num_threads(1)
        with tempfile.TemporaryDirectory() as tmp:
            for step in range(self.first_step, self.cfg.steps):
                yield [self.example(self.seed(step, i), Path(tmp)) for i in range(self.cfg.batch_size)]

    def seed(self, step: int, i: int) -> int:
        """Training seeds cover [0, LONG_HELD_OUT_FROM) in a fixed shuffled-looking order, never repeating
        within a run of fewer than LONG_HELD_OUT_FROM examples."""
        n = step * self.cfg.batch_size + i + self.cfg.seed * 7_777
        return (n * 7_919 + 13) % LONG_HELD_OUT_FROM

    @torch.no_grad()
    def example(self, seed: int, tmp: Path) -> Example:
        ex = make_long_example(seed)
        path = tmp / f"{seed}.mp4"
        write_video(path, ex.frames, FPS)
        frames, _ = load_item_frames(path, None, FPS, None)
        path.unlink()
        t, h, w = frames.shape[0] // 2 + frames.shape[0] % 2, frames.shape[1] // self.spec.patch_size, frames.shape[2] // self.spec.patch_size
        ms = self.spec.merge_size
        n = t * (h // ms) * (w // ms)
        prompt_ids = encode_chat(self.tokenizer, qwen_chat_prompt(PROMPT_SLOT, n), ex.prompt)
        answer_ids = self.tokenizer.encode(ex.answer + "<|im_end|>", add_special_tokens=False)
        ids = torch.tensor(prompt_ids + answer_ids)
        target = self.models["target"]
        is_video = ids == target.config.video_token_id
        grid = torch.tensor([[t, h, w]])
        features = self.tower_features(frames)
        layout = VideoTokenLayout.from_grid(torch.nonzero(is_video).squeeze(1), (t, h // ms, w // ms))
        keep = self.draft_keep(seed, layout, features["target"].float())
        labels = torch.tensor([-100] * len(prompt_ids) + answer_ids)
        seconds = layout.frame * 2 // FPS  # each video token's second: its temporal group holds two frames
        return Example(ids, labels, answer_positions(target, ids, len(prompt_ids), grid), features, keep, ex.kind,
                       seconds)

    def tower_features(self, frames: np.ndarray) -> dict[str, torch.Tensor]:
        """Each model's frozen tower output, (N, D) bfloat16, computed once per distinct temporal group.

        Qwen2.5-VL's tower sees each temporal group on its own (window and full attention stay inside a
        group, its rotary phase is 2-D), and a long-world video holds few distinct groups (long stills), so
        the tower runs on those and their features are copied where they repeat: 3-8x less work."""
        tp = self.spec.temporal_patch_size
        if len(frames) % tp:
            frames = np.concatenate([frames, np.repeat(frames[-1:], tp - len(frames) % tp, axis=0)])
        groups = frames.reshape(-1, tp, *frames.shape[1:])
        first: dict[bytes, int] = {}
        which = [first.setdefault(g.tobytes(), len(first)) for g in groups]
        unique = np.stack([groups[i] for i in sorted({w: i for i, w in reversed(list(enumerate(which)))}.values())])
        pixels, grid = qwen_video_tensors(unique.reshape(-1, *frames.shape[1:]), self.spec)
        per_group = (grid[0, 1] * grid[0, 2] // self.spec.merge_size**2).item()
        index = torch.tensor(which)[:, None] * per_group + torch.arange(per_group)[None, :]
        out = {}
        for name, model in self.models.items():
            feats = torch.cat(list(model.model.get_video_features(pixels, grid).pooler_output))
            out[name] = feats[index.reshape(-1)].to(torch.bfloat16)
        return out

    def draft_keep(self, seed: int, layout: VideoTokenLayout, target_features: torch.Tensor) -> torch.Tensor | None:
        rng = random.Random(seed * 31 + 7)
        c, u = self.cfg, rng.random()
        if u < c.draft_hippo:
            signals = PruningSignals(visual_embeds=target_features)
            return STRATEGIES["hippo_no_attn"].select(signals, layout, PRUNE_RATIO, seed)
        u -= c.draft_hippo
        if u < c.draft_uniform:
            return uniform_keep(layout, PRUNE_RATIO)
        u -= c.draft_uniform
        if u < c.draft_random:
            return random_keep(layout, 1 - rng.uniform(*c.random_keep_range), seed)
        return None


# ---- training -------------------------------------------------------------------------------------------


def answer_positions(model, ids: torch.Tensor, prompt_len: int, grid: torch.Tensor) -> torch.Tensor:
    """(3, L) M-RoPE positions as inference gives them: the prompt's from the model's own `get_rope_index`, the
    answer's continuing from the prompt's largest position + 1 (what the adapters and transformers' generate
    do, vpsd/models/base.py). Not `get_rope_index` over prompt and answer together: since transformers 5.23 it
    starts the text after a video at the video's largest spatial index, below its largest temporal one at these
    lengths, so the answer would sit some 60 positions before where decoding puts it."""
    prompt = ids[:prompt_len]
    types = torch.where(prompt == model.config.video_token_id, 2, 0).to(torch.int32)
    pos, _ = model.model.get_rope_index(prompt[None], mm_token_type_ids=types[None], video_grid_thw=grid,
                                        second_per_grid_ts=torch.tensor([SECONDS_PER_GRID]))
    pos = pos[:, 0]
    answer = int(pos.max()) + 1 + torch.arange(len(ids) - prompt_len)
    return torch.cat([pos, answer.expand(3, -1)], dim=1)


def example_loss(model, ex: Example, name: str, time_head: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Cross-entropy on the answer of one example (`answer`), and of each video token's second read from the
    language model's hidden state half way up (`time`, the auxiliary loss: the captions' time stamps must be
    read from the video tokens' rotary positions, and without it the tiny model stayed at chance on them). The
    draft sees only its kept video tokens, at their original positions."""
    vid = model.config.video_token_id
    is_video = ex.ids == vid
    embeds = model.get_input_embeddings()(ex.ids)
    embeds = embeds.masked_scatter(is_video[:, None], ex.features[name].float())
    sel = torch.ones_like(ex.ids, dtype=torch.bool)
    if name == "draft" and ex.draft_keep is not None:
        video_pos = torch.nonzero(is_video).squeeze(1)
        dropped = torch.ones(video_pos.numel(), dtype=torch.bool)
        dropped[ex.draft_keep] = False
        sel[video_pos[dropped]] = False
    out = model.model.language_model(inputs_embeds=embeds[sel][None], position_ids=ex.positions[:, sel][:, None],
                                     output_hidden_states=True)
    labels = ex.labels[sel]
    answer = torch.nonzero(labels[1:] != -100).squeeze(1)  # rows that predict an answer token
    logits = model.lm_head(out.last_hidden_state[0, answer])
    kept = is_video[sel]
    seconds = ex.seconds if name == "target" or ex.draft_keep is None else ex.seconds[ex.draft_keep]
    middle = out.hidden_states[len(out.hidden_states) // 2][0, kept]
    time_logits = time_head(middle)
    return {"answer": F.cross_entropy(logits, labels[1:][answer]),
            "time": F.cross_entropy(time_logits, seconds),
            "time_acc": (time_logits.argmax(-1) == seconds).float().mean()}


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def freeze_towers(models: dict) -> None:
    for model in models.values():
        for p in model.model.visual.parameters():
            p.requires_grad_(False)


def train(out: Path, cfg: TrainConfig) -> dict:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = long_tokenizer()
    models = build_models(tokenizer, Path(cfg.init))
    freeze_towers(models)
    # Training only, not saved: each model's head reading the second from its middle hidden state.
    heads = {n: torch.nn.Linear(m.config.text_config.hidden_size, DURATION_S[1] + 1) for n, m in models.items()}
    opts = {n: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad] + list(heads[n].parameters()),
                                 lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
            for n, m in models.items()}
    resume = out / "resume" / "state.pt"
    start, history, elapsed = 0, [], 0.0
    if resume.exists():
        state = torch.load(resume, weights_only=False)
        for n in models:
            models[n].load_state_dict(state["models"][n])
            heads[n].load_state_dict(state["heads"][n])
            opts[n].load_state_dict(state["opts"][n])
        start, history, elapsed = state["step"], state["history"], state["elapsed"]
        print(f"resuming at step {start} of {cfg.steps} ({elapsed / 60:.1f} min trained)", flush=True)
    stream = LongStream(cfg, models, tokenizer, start)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=1, prefetch_factor=2)
    t0 = time.time() - elapsed
    progress = tqdm(loader, initial=start, total=cfg.steps, unit="step", disable=None, mininterval=30)
    for step, examples in enumerate(progress, start):
        lr = lr_at(step, cfg)
        row: dict = {"step": step, "lr": lr, "video_tokens": [int((e.ids == models["target"].config.video_token_id).sum()) for e in examples]}
        for name, model in models.items():
            model.train()
            for g in opts[name].param_groups:
                g["lr"] = lr
            opts[name].zero_grad(set_to_none=True)
            losses: dict[str, list[float]] = {"caption": [], "question": [], "time": [], "time_acc": []}
            for ex in examples:
                res = example_loss(model, ex, name, heads[name])
                ((res["answer"] + cfg.time_weight * res["time"]) / len(examples)).backward()
                losses[ex.kind].append(res["answer"].item())
                losses["time"].append(res["time"].item())
                losses["time_acc"].append(res["time_acc"].item())
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            opts[name].step()
            row[name] = {k: float(np.mean(v)) for k, v in losses.items() if v}
        history.append(row)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            el = time.time() - t0
            parts = "  ".join(f"{n} " + " ".join(f"{k[:5]} {v:.3f}" for k, v in row[n].items()) for n in models)
            progress.write(f"step {step:4d}  {parts}  lr {lr:.1e}  {el / (step + 1):.1f} s/step  {el / 60:.1f} min")
        if (step + 1) % cfg.save_every == 0 or step == cfg.steps - 1:
            save_resume(resume, models, heads, opts, step + 1, history, time.time() - t0)
    for name, model in models.items():
        save(model.eval(), tokenizer, out / name, Path(cfg.init))
    meta = {"config": asdict(cfg), "train_seconds": time.time() - t0, "final": history[-1] if history else None}
    (out / "train_log.json").write_text(json.dumps({"meta": meta, "history": history}))
    return meta


def save_resume(path: Path, models: dict, heads: dict, opts: dict, step: int, history: list, elapsed: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"models": {n: m.state_dict() for n, m in models.items()},
                "heads": {n: h.state_dict() for n, h in heads.items()},
                "opts": {n: o.state_dict() for n, o in opts.items()},
                "step": step, "history": history, "elapsed": elapsed}, tmp)
    tmp.replace(path)  # a run killed mid-write keeps the previous state


def save(model, tokenizer, path: Path, init: Path = SHORT_PAIR) -> None:
    """A checkpoint in the official layout, bfloat16 on disk as the short pair's (loading upcasts to float32,
    which decoding then uses): the short pair's chat template and video processor settings, at the long
    world's frame rate."""
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    model.save_pretrained(path, state_dict=state, safe_serialization=True)
    source = init / path.name
    tokenizer.chat_template = json.loads((source / "tokenizer_config.json").read_text())["chat_template"]
    tokenizer.save_pretrained(path)
    processor = json.loads((source / "video_preprocessor_config.json").read_text())
    (path / "video_preprocessor_config.json").write_text(json.dumps({**processor, "fps": float(FPS)}, indent=2))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--threads", type=int, default=TrainConfig.threads)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default=TrainConfig.init, help="the short pair to start from (target/ and draft/)")
    a = p.parse_args(argv)
    cfg = TrainConfig(steps=a.steps, batch_size=a.batch_size, lr=a.lr, threads=a.threads, seed=a.seed, init=a.init)
    meta = train(a.out, cfg)
    print(f"trained in {meta['train_seconds'] / 60:.1f} min; wrote {a.out}/target and {a.out}/draft")


if __name__ == "__main__":
    main()
