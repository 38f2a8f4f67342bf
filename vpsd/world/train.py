"""Trains the embedded default pair on the procedural world: a tiny Qwen2.5-VL target and a smaller draft.

Contract:
- `python -m vpsd.world.train --out checkpoints/world_qwen2_5_vl` trains both models from scratch on CPU
  (seeded; fresh examples every step, never a held-out seed) and writes `target/` and `draft/`, each a
  transformers checkpoint (safetensors, bfloat16 on disk to keep the repo small) with the shared tokenizer.
- Training sees exactly what inference sees: every example goes through an mp4 encode and the real PyAV
  decode path (`load_item_frames`, 4:2:0 chroma and all), the adapters' chat prompt, and video tensors
  built by `qwen_video_tensors`. The loss is next-token cross-entropy on the answer (caption + <|im_end|>).
- The draft also trains on pruned video (random video tokens dropped, each kept token at its original
  rotary position, as a pruned prefill feeds it), so it keeps agreeing with the target when the pruner
  leaves it 10% of the video. The target always sees the whole video.
- Held-out seeds (`HELD_OUT_SEEDS`) are never trained on; `vpsd.world.evaluate` measures on them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vpsd.models.qwen2_5_vl import qwen_chat_prompt, tiny_config
from vpsd.models.qwen_video import QwenVisionSpec, qwen_video_tensors
from vpsd.models.tokenizer import build_tokenizer
from vpsd.video.item import load_item_frames
from vpsd.video.sampling import uniform_indices
from vpsd.world.caption import PROMPTS, caption
from vpsd.world.dataset import make_example, write_video
from vpsd.world.scene import COLOURS, MOTIONS, SHAPES, SIZES, Scene, sample_scene

# Seeds: training draws from TRAIN_SEED_BASE upwards; held-out items (demo, evaluation) live below it.
TRAIN_SEED_BASE = 1_000_000
HELD_OUT_SEEDS = range(1000, 1200)
VIDEO_FRAMES = 16  # frames per generated video
NUM_FRAMES = 8  # frames sampled per item (configs/world_qwen2_5_vl.yaml uses the same)
SIZE = (112, 112)

# 7-pixel patches merged 4x4: the LM still sees one token per 28x28 cell (64 per temporal pair of frames at
# 112 px), but the towers see each object as a few patches. With 14-pixel patches a linear probe on the
# trained tower read colour (93%) and size (93%) but not shape (40%, chance 33%): a 9-pixel object is a
# sub-patch pattern that shifts with the object's offset.
VISION = dict(patch_size=7, spatial_merge_size=4, temporal_patch_size=2, window_size=56)
TARGET = dict(
    text=dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    vision=dict(depth=2, hidden_size=96, intermediate_size=192, num_heads=2, fullatt_block_indexes=[1], **VISION),
)
DRAFT = dict(
    text=dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
    vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, fullatt_block_indexes=[1], **VISION),
)


@dataclass
class TrainConfig:
    steps: int = 1500
    batch_size: int = 16
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    seed: int = 0
    draft_prune_prob: float = 0.5  # share of draft batches trained on pruned video
    draft_keep_range: tuple[float, float] = (0.08, 0.6)  # kept share of video tokens in those batches
    log_every: int = 25
    save_every: int = 250  # checkpoints along the way, so a long run can be evaluated (and resumed by hand)
    threads: int = 1
    aux_weight: float = 0.5
    init: str | None = None  # continue from a checkpoint directory written by this trainer (fresh optimizer)
    sizes: dict = field(default_factory=lambda: {"target": TARGET, "draft": DRAFT})
    stop_after: int | None = None  # end after this many steps of the `steps`-long schedule


def sizes_for_patch(patch: int) -> dict:
    """The model sizes with a `patch`-pixel tower (14: the towers of the first training phases, whose
    draft tower had one block; see scripts/train_world.sh)."""
    vision = dict(patch_size=patch, spatial_merge_size=MERGED_CELL // patch)
    sizes = {name: {"text": size["text"], "vision": {**size["vision"], **vision}}
             for name, size in (("target", TARGET), ("draft", DRAFT))}
    if patch == 14:
        sizes["draft"]["vision"].update(depth=1, fullatt_block_indexes=[0])
    return sizes


def world_tokenizer():
    """The shared tokenizer: byte-level BPE whose corpus includes captions, so caption words are single tokens."""
    rng = random.Random(0)
    corpus = [caption(sample_scene(TRAIN_SEED_BASE + rng.randrange(10**6), VIDEO_FRAMES, SIZE)) for _ in range(3000)]
    return build_tokenizer(vocab_size=768, extra_corpus=corpus + list(PROMPTS))


@dataclass
class Example:
    frames: np.ndarray  # (NUM_FRAMES, H, W, 3) uint8 as the real decode path returns them
    prompt: str
    answer: str
    token_labels: np.ndarray  # (video tokens, len(ATTRIBUTES)) class ids, see token_labels()


# Dense auxiliary supervision for the vision towers (training only; the heads are not saved): for each
# merged video token, what object (if any) has its centre in the token's cell. Learning to see 9-pixel
# objects from the caption loss alone takes far longer than a CPU hour; per-token labels straight from
# the scene make the towers find objects within a few hundred steps.
ATTRIBUTES = {
    "colour": ("none", *COLOURS),
    "shape": ("none", *SHAPES),
    "size": ("none", *SIZES),
    "motion": ("none", *MOTIONS),
}
MERGED_CELL = 28  # pixels per merged Qwen token side (patch x merge)


def token_labels(scene: Scene) -> np.ndarray:
    """Labels in the adapters' video-token order: temporal group, row, column (frames as load_item_frames samples them)."""
    frames = uniform_indices(VIDEO_FRAMES, NUM_FRAMES)[::2]  # first frame of each temporal pair
    rows, cols = scene.height // MERGED_CELL, scene.width // MERGED_CELL
    labels = np.zeros((len(frames), rows, cols, len(ATTRIBUTES)), dtype=np.int64)
    for g, t in enumerate(frames):
        for obj in scene.objects:
            if not obj.visible(int(t)):
                continue
            x, y = obj.centre(int(t))
            if not (0 <= x < 1 and 0 <= y < 1):
                continue
            values = (obj.colour_at(int(t)), obj.shape, obj.size, obj.motion)
            labels[g, int(y * rows), int(x * cols)] = [ATTRIBUTES[k].index(v) for k, v in zip(ATTRIBUTES, values)]
    return labels.reshape(-1, len(ATTRIBUTES))


class AuxHeads(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.heads = torch.nn.ModuleList(torch.nn.Linear(dim, len(v)) for v in ATTRIBUTES.values())

    def loss(self, feats: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return sum(F.cross_entropy(h(feats), labels[:, i]) for i, h in enumerate(self.heads))


def roundtrip_example(seed: int, workdir: Path) -> Example:
    """Renders a world example and passes it through mp4 and PyAV, as a manifest item would be."""
    ex = make_example(seed, VIDEO_FRAMES, SIZE)
    path = workdir / f"{seed}.mp4"
    write_video(path, ex.frames)
    frames = load_item_frames(path, NUM_FRAMES, None, None)
    path.unlink()
    return Example(frames, ex.prompt, ex.caption, token_labels(ex.scene))


class ExampleStream(torch.utils.data.IterableDataset):
    """Batches of fresh round-tripped examples, made in a DataLoader worker so the mp4 work overlaps training."""

    def __init__(self, first_seed: int, batch_size: int, steps: int):
        self.first_seed, self.batch_size, self.steps = first_seed, batch_size, steps

    def __iter__(self):
        with tempfile.TemporaryDirectory() as tmp:
            for step in range(self.steps):
                seed = self.first_seed + step * self.batch_size
                yield [roundtrip_example(seed + i, Path(tmp)) for i in range(self.batch_size)]


class Batcher:
    """Token ids, labels, rotary positions and video tensors for a list of examples (right-padded)."""

    def __init__(self, tokenizer, model_config):
        self.tok = tokenizer
        self.video_token_id = model_config.video_token_id
        vc = model_config.vision_config
        self.spec = QwenVisionSpec(patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                                   temporal_patch_size=vc.temporal_patch_size)

    def __call__(self, examples: list[Example], rope_index) -> dict:
        pixels, grids, seqs, labels, types = [], [], [], [], []
        for ex in examples:
            pv, grid = qwen_video_tensors(ex.frames, self.spec)
            t, h, w = (int(v) for v in grid[0])
            ms = self.spec.merge_size
            n = t * (h // ms) * (w // ms)
            prompt_ids = self.tok.encode(qwen_chat_prompt(ex.prompt, n), add_special_tokens=False)
            answer_ids = self.tok.encode(ex.answer + "<|im_end|>", add_special_tokens=False)
            ids = torch.tensor(prompt_ids + answer_ids)
            pixels.append(pv)
            grids.append(grid)
            seqs.append(ids)
            labels.append(torch.tensor([-100] * len(prompt_ids) + answer_ids))
            types.append(torch.where(ids == self.video_token_id, 2, 0).to(torch.int32))
        grid = torch.cat(grids)
        positions = []
        for ids, ty, g in zip(seqs, types, grid):
            pos, _ = rope_index(ids[None], mm_token_type_ids=ty[None], video_grid_thw=g[None],
                                second_per_grid_ts=torch.tensor([1.0]))
            positions.append(pos[:, 0])  # (3, L)
        token_labels = torch.from_numpy(np.concatenate([ex.token_labels for ex in examples]))
        return dict(ids=seqs, labels=labels, positions=positions, pixels=torch.cat(pixels), grid=grid,
                    token_labels=token_labels)


def forward_loss(model, aux: AuxHeads, batch: dict, video_token_id: int, keep_share: float | None,
                 rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy on the answers (with keep_share, each item keeps that share of its video tokens),
    and the auxiliary per-token loss of the vision tower."""
    feats = torch.cat(list(model.model.get_video_features(batch["pixels"], batch["grid"]).pooler_output))
    aux_loss = aux.loss(feats, batch["token_labels"])
    embed = model.model.get_input_embeddings()
    rows, offset = [], 0
    for ids, labels, pos in zip(batch["ids"], batch["labels"], batch["positions"]):
        is_video = ids == video_token_id
        n = int(is_video.sum())
        e = embed(ids).masked_scatter(is_video[:, None], feats[offset : offset + n])
        offset += n
        sel = torch.ones_like(ids, dtype=torch.bool)
        if keep_share is not None:
            k = max(1, round(keep_share * n))
            kept = torch.randperm(n, generator=rng)[:k]
            drop = torch.ones(n, dtype=torch.bool)
            drop[kept] = False
            sel[torch.nonzero(is_video).squeeze(1)[drop]] = False
        rows.append((e[sel], labels[sel], pos[:, sel]))
    length = max(r[0].shape[0] for r in rows)
    b, d = len(rows), rows[0][0].shape[1]
    embeds = torch.zeros(b, length, d)
    targets = torch.full((b, length), -100, dtype=torch.long)
    positions = torch.zeros(3, b, length, dtype=torch.long)
    mask = torch.zeros(b, length, dtype=torch.long)
    for i, (e, lab, pos) in enumerate(rows):
        n = e.shape[0]
        embeds[i, :n], targets[i, :n], positions[:, i, :n], mask[i, :n] = e, lab, pos, 1
    out = model.model.language_model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask)
    logits = model.lm_head(out.last_hidden_state)
    lm_loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1), ignore_index=-100)
    return lm_loss, aux_loss


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def build_models(tokenizer, cfg: TrainConfig):
    from transformers import Qwen2_5_VLForConditionalGeneration

    models = {}
    for i, name in enumerate(("target", "draft")):
        size = cfg.sizes[name]
        torch.manual_seed(cfg.seed + i)
        config = tiny_config(dict(size["text"]), dict(size["vision"]), tokenizer)
        config._attn_implementation = "sdpa"
        models[name] = Qwen2_5_VLForConditionalGeneration(config)
        if cfg.init is not None:
            # Every weight whose shape still matches comes from the checkpoint; a tower whose patch size
            # changed starts afresh while the language model keeps what it learned.
            old = Qwen2_5_VLForConditionalGeneration.from_pretrained(Path(cfg.init) / name, dtype=torch.float32)
            own = models[name].state_dict()
            kept = {k: v for k, v in old.state_dict().items() if k in own and own[k].shape == v.shape
                    and not (k.startswith("model.visual.") and old.config.vision_config.patch_size
                             != config.vision_config.patch_size)}
            models[name].load_state_dict(kept, strict=False)
            print(f"{name}: {len(kept)} of {len(own)} tensors from {cfg.init}", flush=True)
    return models


def train(out: Path, cfg: TrainConfig) -> dict:
    torch.set_num_threads(cfg.threads)
    tokenizer = world_tokenizer()
    models = build_models(tokenizer, cfg)
    auxes = {n: AuxHeads(m.config.text_config.hidden_size) for n, m in models.items()}
    opts = {n: torch.optim.AdamW([*m.parameters(), *auxes[n].parameters()], lr=cfg.lr,
                                 weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
            for n, m in models.items()}
    batcher = Batcher(tokenizer, models["target"].config)
    rope_index = models["target"].model.get_rope_index  # positions depend only on the token layout
    vid = models["target"].config.video_token_id
    rng = torch.Generator().manual_seed(cfg.seed)
    pyrng = random.Random(cfg.seed)
    history = []
    t0 = time.time()
    stream = ExampleStream(TRAIN_SEED_BASE + cfg.seed * 10_000_000, cfg.batch_size, cfg.stop_after or cfg.steps)
    # One worker process makes the data; torch's own threads stay at cfg.threads (1 is best on a busy
    # 2-core machine: OpenMP threads spin-wait for each other when one of them is preempted).
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=1, prefetch_factor=4)
    for step, examples in enumerate(loader):
        batch = batcher(examples, rope_index)
        lr = lr_at(step, cfg)
        keep = pyrng.uniform(*cfg.draft_keep_range) if pyrng.random() < cfg.draft_prune_prob else None
        losses = {}
        for name, model in models.items():
            model.train()
            for g in opts[name].param_groups:
                g["lr"] = lr
            lm_loss, aux_loss = forward_loss(model, auxes[name], batch, vid, keep if name == "draft" else None, rng)
            loss = lm_loss + cfg.aux_weight * aux_loss
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opts[name].step()
            losses[name] = lm_loss.item()
            losses[f"{name}_aux"] = aux_loss.item()
        history.append({"step": step, "lr": lr, "draft_keep": keep, **losses})
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            el = time.time() - t0
            print(f"step {step:5d}  target {losses['target']:.4f} (aux {losses['target_aux']:.3f})  "
                  f"draft {losses['draft']:.4f} (aux {losses['draft_aux']:.3f})  "
                  f"lr {lr:.2e}  {el / (step + 1):.2f} s/step  elapsed {el / 60:.1f} min", flush=True)
        if (step + 1) % cfg.save_every == 0:
            for name, model in models.items():
                save(model, tokenizer, out / name)
    for name, model in models.items():
        save(model.eval(), tokenizer, out / name)
    meta = {"config": asdict(cfg), "train_seconds": time.time() - t0, "final": history[-1]}
    (out / "train_log.json").write_text(json.dumps({"meta": meta, "history": history}))
    return meta


def save(model, tokenizer, path: Path) -> None:
    """bfloat16 on disk halves the repo's footprint; loading upcasts to float32, which decoding then uses."""
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    model.save_pretrained(path, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--threads", type=int, default=TrainConfig.threads)
    p.add_argument("--seed", type=int, default=0, help="also picks the training seeds: use a new one when continuing")
    p.add_argument("--init", help="continue from the target/ and draft/ checkpoints in this directory")
    p.add_argument("--aux-weight", type=float, default=TrainConfig.aux_weight, help="weight of the per-token vision loss")
    p.add_argument("--stop-after", type=int, help="stop after this many steps of the --steps schedule")
    p.add_argument("--patch", type=int, default=VISION["patch_size"], choices=(7, 14),
                   help="vision patch side; the merge makes every LM token a 28-pixel cell either way")
    a = p.parse_args(argv)
    cfg = TrainConfig(steps=a.steps, batch_size=a.batch_size, lr=a.lr, threads=a.threads, seed=a.seed, init=a.init,
                      aux_weight=a.aux_weight, stop_after=a.stop_after, sizes=sizes_for_patch(a.patch))
    meta = train(a.out, cfg)
    print(f"trained in {meta['train_seconds'] / 60:.1f} min; wrote {a.out}/target and {a.out}/draft")


if __name__ == "__main__":
    main()
