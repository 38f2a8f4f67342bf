"""Trains the embedded default pair on the procedural world: a tiny Qwen2.5-VL target and a smaller draft.

Contract:
- `python -m training.world_short --out checkpoints/world_qwen2_5_vl` trains both models from scratch on CPU
  (seeded; fresh examples every step, never a held-out seed) and writes `target/` and `draft/`, each a
  transformers checkpoint (safetensors, bfloat16 on disk to keep the repo small) with the shared tokenizer.
- Training sees exactly what inference sees: every example goes through an mp4 encode and the real PyAV
  decode path (`load_item_frames`, 4:2:0 chroma and all), the adapters' chat prompt, and video tensors
  built by `qwen_video_tensors`.
- Two stages in one run. Stage 1 (`vision_steps`) trains the vision towers alone on labels read from the
  scene, per patch and per merged token (colour, shape, size and motion of the object there, background).
  Stage 2 (`steps`) trains the language models on next-token cross-entropy of the answer (caption +
  <|im_end|>), and with them the towers' mergers; the tower blocks stay frozen: their backward pass cost
  more than the language models' whole step, so freezing them buys the language models about twice the
  steps in the CPU hour.
- The draft also trains on pruned video (random video tokens dropped, each kept token at its original
  rotary position, as a pruned prefill feeds it), so it keeps agreeing with the target when the pruner
  leaves it 10% of the video. The target always sees the whole video.
- Held-out seeds (`HELD_OUT_SEEDS`) are never trained on; `training.evaluate` measures on them.
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
from tqdm.auto import tqdm

from vpsd.models.qwen2_5_vl import qwen_chat_prompt, tiny_config
from vpsd.models.qwen_video import QwenVisionSpec, qwen_video_tensors
from vpsd.models.tokenizer import build_tokenizer
from vpsd.video.item import load_item_frames
from vpsd.video.sampling import uniform_indices
from vpsd.world.caption import PROMPTS, caption
from vpsd.world.dataset import make_example, write_video
from vpsd.world.render import coverage
from vpsd.world.scene import BACKGROUNDS, COLOURS, LATTICE, MOTIONS, SHAPES, SIZES, Scene, sample_scene

# Seeds: training draws from TRAIN_SEED_BASE upwards; held-out items (demo, evaluation) live below it.
TRAIN_SEED_BASE = 1_000_000
HELD_OUT_SEEDS = range(1000, 1200)
VIDEO_FRAMES = 16  # frames per generated video
NUM_FRAMES = 8  # frames sampled per item (configs/world_qwen2_5_vl.yaml uses the same)
SIZE = (112, 112)

# 7-pixel patches merged 4x4: the LM sees one token per 28x28 cell (16 per temporal pair of frames at
# 112 px, 64 per video) and the towers see each object as a few patches. The world's lattice equals the
# patch side, so a shape is the same patches wherever it is (vpsd.world.scene); with 14-pixel patches, or
# objects off the lattice, a probe on the trained tower read shape at chance.
VISION = dict(patch_size=LATTICE, spatial_merge_size=4, temporal_patch_size=2, window_size=56)
MERGED_CELL = VISION["patch_size"] * VISION["spatial_merge_size"]  # pixels per merged video token side
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
    vision_steps: int = 600  # stage 1: the towers alone, on their per-patch and per-token labels
    steps: int = 2000  # stage 2: the language models and mergers on captions, the tower blocks frozen
    batch_size: int = 16
    vision_lr: float = 6e-3
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.01
    seed: int = 0
    draft_prune_prob: float = 0.5  # share of draft batches trained on pruned video
    draft_keep_range: tuple[float, float] = (0.08, 0.6)  # kept share of video tokens in those batches
    log_every: int = 25
    save_every: int = 250  # checkpoints along the way, so a long run can be evaluated (and resumed by hand)
    threads: int = 1
    init: str | None = None  # continue from a checkpoint directory written by this trainer (fresh optimizer)
    sizes: dict = field(default_factory=lambda: {"target": TARGET, "draft": DRAFT})
    stop_after: int | None = None  # end after this many steps of the whole schedule


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
    patch_labels: np.ndarray  # (vision patches, NUM_LABELS) class ids, see cell_labels()
    token_labels: np.ndarray  # (video tokens, NUM_LABELS)


# Dense auxiliary supervision for the vision towers (training only; the heads are not saved). Learning to
# see 9-pixel objects from the caption loss alone takes far longer than a CPU hour, so every patch learns
# which object covers it (colour, shape, size, motion) and what the background is, and every merged token
# learns the same for the objects in its cell. Motion is visible to the tower: each temporal patch pairs two
# frames, between which a moving object always shifts (vpsd.world.scene.SPEED_PX).
OBJECT_ATTRIBUTES = {"colour": ("none", *COLOURS), "shape": SHAPES, "size": tuple(SIZES), "motion": MOTIONS}
BACKGROUND_CLASSES = tuple(f"{colour} {kind}" for colour in BACKGROUNDS for kind in ("plain", "textured"))
NUM_LABELS = len(OBJECT_ATTRIBUTES) + 1  # columns of a label row: the object's attributes, then background
IGNORE = -100  # attributes (but colour "none") of a cell no object covers: no loss
PATCH_COVER = 0.3  # share of a patch an object must cover to label it
TOKEN_COVER = 0.1  # same for a merged token's 28-pixel cell, whose objects are often split between cells


def cell_labels(scene: Scene, cell: int, min_cover: float) -> np.ndarray:
    """(temporal groups, rows, cols, NUM_LABELS) labels of `cell`-pixel squares, on the first frame of each
    temporal pair as load_item_frames samples them. An object labels the cells it covers by `min_cover`."""
    frames = uniform_indices(VIDEO_FRAMES, NUM_FRAMES)[::2]
    h, w = scene.height, scene.width
    rows, cols = h // cell, w // cell
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32) + 0.5  # pixel centres
    bg = BACKGROUND_CLASSES.index(f"{scene.background.colour} {'textured' if scene.background.textured else 'plain'}")
    labels = np.full((len(frames), rows, cols, NUM_LABELS), IGNORE, dtype=np.int64)
    labels[..., 0], labels[..., -1] = 0, bg
    for g, t in enumerate(int(f) for f in frames):
        for obj in scene.objects:
            if not obj.visible(t):
                continue
            cx, cy = obj.centre(t)
            inside = coverage(obj.shape, xx - cx * w, yy - cy * h, obj.radius * min(h, w))
            covered = inside.reshape(rows, cell, cols, cell).mean(axis=(1, 3)) >= min_cover
            values = (obj.colour_at(t), obj.shape, obj.size, obj.motion)
            labels[g][covered, :-1] = [names.index(v) for names, v in zip(OBJECT_ATTRIBUTES.values(), values)]
    return labels


def qwen_order(labels: np.ndarray, merge: int) -> np.ndarray:
    """Rows of a (groups, rows, cols, k) label grid in the order Qwen's processor lays patches out:
    group, merged row, merged column, then the merge x merge patches inside each merged cell."""
    g, rows, cols, k = labels.shape
    grid = labels.reshape(g, rows // merge, merge, cols // merge, merge, k).transpose(0, 1, 3, 2, 4, 5)
    return grid.reshape(-1, k)


def patch_labels(scene: Scene) -> np.ndarray:
    return qwen_order(cell_labels(scene, VISION["patch_size"], PATCH_COVER), VISION["spatial_merge_size"])


def token_labels(scene: Scene) -> np.ndarray:
    """Labels in the adapters' video-token order: temporal group, row, column."""
    return cell_labels(scene, MERGED_CELL, TOKEN_COVER).reshape(-1, NUM_LABELS)


class VisionHeads(torch.nn.Module):
    """Linear heads reading the labels from one feature width (the tower's patches or the merged tokens)."""

    def __init__(self, dim: int):
        super().__init__()
        sizes = [len(v) for v in OBJECT_ATTRIBUTES.values()] + [len(BACKGROUND_CLASSES)]
        self.heads = torch.nn.ModuleList(torch.nn.Linear(dim, n) for n in sizes)

    def loss(self, feats: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return sum(F.cross_entropy(h(feats), labels[:, i], ignore_index=IGNORE) for i, h in enumerate(self.heads))

    @torch.no_grad()
    def accuracy(self, feats: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Per-label accuracy where an object is present (background: everywhere), for the training log."""
        out, has_object = {}, labels[:, 0] > 0
        for i, (name, h) in enumerate(zip((*OBJECT_ATTRIBUTES, "background"), self.heads)):
            rows = slice(None) if name == "background" else has_object
            out[name] = (h(feats[rows]).argmax(-1) == labels[rows, i]).float().mean().item()
        return out


class AuxHeads(torch.nn.Module):
    def __init__(self, patch_dim: int, token_dim: int):
        super().__init__()
        self.patch, self.token = VisionHeads(patch_dim), VisionHeads(token_dim)


def vision_features(model, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(patch features in the processor's patch order, merged video-token features) of the model's tower."""
    from transformers.vision_utils import get_vision_window_index

    visual = model.model.visual
    out = visual(pixels.type(visual.dtype), grid_thw=grid)
    # The tower runs its patches in window order and restores the order only after merging.
    window_index, _ = get_vision_window_index(grid, spatial_merge_size=visual.spatial_merge_size,
                                              window_size=visual.window_size, patch_size=visual.patch_size)
    h = out.last_hidden_state
    unit = visual.spatial_merge_size**2
    patches = h.reshape(-1, unit, h.shape[-1])[torch.argsort(window_index)].reshape(-1, h.shape[-1])
    return patches, out.pooler_output


def roundtrip_example(seed: int, workdir: Path) -> Example:
    """Renders a world example and passes it through mp4 and PyAV, as a manifest item would be."""
    ex = make_example(seed, VIDEO_FRAMES, SIZE)
    path = workdir / f"{seed}.mp4"
    write_video(path, ex.frames)
    frames, _ = load_item_frames(path, NUM_FRAMES, None, None)
    path.unlink()
    return Example(frames, ex.prompt, ex.caption, patch_labels(ex.scene), token_labels(ex.scene))


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
                                # frames taken as 2 fps (the adapter's default), whatever their real spacing:
                                # configs/world_qwen2_5_vl.yaml says so with use_frame_times: false
                                second_per_grid_ts=torch.tensor([1.0]))
            positions.append(pos[:, 0])  # (3, L)
        return dict(ids=seqs, labels=labels, positions=positions, pixels=torch.cat(pixels), grid=grid,
                    patch_labels=torch.from_numpy(np.concatenate([ex.patch_labels for ex in examples])),
                    token_labels=torch.from_numpy(np.concatenate([ex.token_labels for ex in examples])))


def forward_loss(model, aux: AuxHeads, batch: dict, video_token_id: int, keep_share: float | None,
                 rng: torch.Generator, with_captions: bool = True) -> dict:
    """Stage 1 (not `with_captions`): `aux`, the towers' loss on their per-patch and per-token labels.
    Stage 2: `lm`, cross-entropy on the answers, with the tower blocks frozen (with keep_share, each item keeps
    that share of its video tokens). Also returns the features, for the log's probe accuracies."""
    # Stage 2 trains the merger with the language model: it is the one place where the 4x4 patches of a token
    # meet, so only it can learn what the captions need beyond the stage-1 labels (how much of an object a
    # token holds and where, from which its size, shape and place are read across tokens). Parameters that
    # need no grad keep autograd from recording the blocks at all: the frozen blocks cost a forward pass only.
    for name, p in model.model.visual.named_parameters():
        p.requires_grad_(not with_captions or name.startswith("merger."))
    patches, feats = vision_features(model, batch["pixels"], batch["grid"])
    out = {"patches": patches.detach(), "tokens": feats.detach()}
    if not with_captions:
        out["aux"] = aux.patch.loss(patches, batch["patch_labels"]) + aux.token.loss(feats, batch["token_labels"])
        return out
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
    hidden = model.model.language_model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask)
    logits = model.lm_head(hidden.last_hidden_state)
    out["lm"] = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1),
                                ignore_index=-100)
    return out


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Stage 1 (the first `vision_steps`): warm up to `vision_lr` and hold. Stage 2: warm up to `lr`,
    then cosine down to 5% of it at the end of `vision_steps + steps`."""
    if step < cfg.vision_steps:
        return cfg.vision_lr * min(1.0, (step + 1) / cfg.warmup)
    step -= cfg.vision_steps
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
            # Every weight whose shape still matches comes from the checkpoint.
            old = Qwen2_5_VLForConditionalGeneration.from_pretrained(Path(cfg.init) / name, dtype=torch.float32)
            own = models[name].state_dict()
            kept = {k: v for k, v in old.state_dict().items() if k in own and own[k].shape == v.shape}
            models[name].load_state_dict(kept, strict=False)
            print(f"{name}: {len(kept)} of {len(own)} tensors from {cfg.init}", flush=True)
    return models


def train(out: Path, cfg: TrainConfig) -> dict:
    torch.set_num_threads(cfg.threads)
    tokenizer = world_tokenizer()
    models = build_models(tokenizer, cfg)
    auxes = {n: AuxHeads(m.config.vision_config.hidden_size, m.config.text_config.hidden_size)
             for n, m in models.items()}
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
    total = cfg.vision_steps + cfg.steps
    stream = ExampleStream(TRAIN_SEED_BASE + cfg.seed * 10_000_000, cfg.batch_size, cfg.stop_after or total)
    # One worker process makes the data; torch's own threads stay at cfg.threads (1 is best on a busy
    # 2-core machine: OpenMP threads spin-wait for each other when one of them is preempted).
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=1, prefetch_factor=4)
    progress = tqdm(loader, total=cfg.stop_after or total, unit="step", disable=None, mininterval=10)
    for step, examples in enumerate(progress):
        batch = batcher(examples, rope_index)
        lr = lr_at(step, cfg)
        captions = step >= cfg.vision_steps  # stage 1 trains the towers alone, on their labels
        keep = pyrng.uniform(*cfg.draft_keep_range) if pyrng.random() < cfg.draft_prune_prob else None
        row = {"step": step, "lr": lr, "draft_keep": keep if captions else None}
        log = step % cfg.log_every == 0 or step == total - 1
        for name, model in models.items():
            model.train()
            for g in opts[name].param_groups:
                g["lr"] = lr
            res = forward_loss(model, auxes[name], batch, vid, keep if name == "draft" else None, rng, captions)
            loss = res["lm"] if captions else res["aux"]
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opts[name].step()
            row[name if captions else f"{name}_aux"] = (res["lm"] if captions else res["aux"]).item()
            if log:
                row[f"{name}_patch_acc"] = auxes[name].patch.accuracy(res["patches"], batch["patch_labels"])
                row[f"{name}_token_acc"] = auxes[name].token.accuracy(res["tokens"], batch["token_labels"])
        history.append(row)
        if log:
            el = time.time() - t0
            parts = [f"{n} lm {row.get(n, float('nan')):.3f} aux {row.get(f'{n}_aux', float('nan')):.2f} patch "
                     + " ".join(f"{k[:2]} {v:.2f}" for k, v in row[f"{n}_patch_acc"].items()) for n in models]
            progress.write(f"step {step:5d}  " + "  |  ".join(parts)
                           + f"  lr {lr:.1e}  {el / (step + 1):.2f} s/step  {el / 60:.1f} min")
        if (step + 1) % cfg.save_every == 0 and captions:
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
    p.add_argument("--vision-steps", type=int, default=TrainConfig.vision_steps, help="stage 1: towers alone")
    p.add_argument("--steps", type=int, default=TrainConfig.steps, help="stage 2: captions")
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--threads", type=int, default=TrainConfig.threads)
    p.add_argument("--seed", type=int, default=0, help="also picks the training seeds: use a new one when continuing")
    p.add_argument("--init", help="continue from the target/ and draft/ checkpoints in this directory")
    p.add_argument("--stop-after", type=int, help="stop after this many steps of the whole schedule")
    a = p.parse_args(argv)
    cfg = TrainConfig(vision_steps=a.vision_steps, steps=a.steps, batch_size=a.batch_size, lr=a.lr,
                      threads=a.threads, seed=a.seed, init=a.init, stop_after=a.stop_after)
    meta = train(a.out, cfg)
    print(f"trained in {meta['train_seconds'] / 60:.1f} min; wrote {a.out}/target and {a.out}/draft")


if __name__ == "__main__":
    main()
