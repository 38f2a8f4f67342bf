"""Rasterise a `Scene` or a `LongScene` into RGB frames with numpy.

Contract: `render(scene)` is a pure function of the scene and returns (T, H, W, 3) uint8 RGB. It reads
what both scene kinds have (frame count and size, background, objects with `visible`, `centre`,
`colour_at`, `shape_at`), and a long scene's blinking distractor.
Edges are anti-aliased by supersampling each object's bounding box, so a shape's outline moves
smoothly instead of snapping between pixels (the model should see motion, not aliasing).
Objects are painted in scene order; the sampler guarantees they never overlap.
"""

from __future__ import annotations

import numpy as np

from vpsd.world.long_scene import LongScene
from vpsd.world.scene import BACKGROUNDS, COLOURS, Background, Scene, SceneObject

SUPERSAMPLE = 4  # sub-pixels per pixel side
TEXTURE_AMPLITUDE = 22.0  # intensity levels: visible as texture, never mistaken for an object


# The long world's distractor: a checker of two dull colours no object has, so it never reads as one.
DISTRACTOR_COLOURS = ((90, 70, 150), (150, 150, 90))


def render(scene: Scene | LongScene) -> np.ndarray:
    """(T, H, W, 3) uint8 RGB frames of `scene`."""
    base = background(scene.background, scene.height, scene.width)
    frames = np.repeat(base[None], scene.num_frames, axis=0)
    painted: dict[tuple, int] = {}  # what a frame shows -> the first frame that showed it (long stills)
    for t in range(scene.num_frames):
        shown = tuple((i, obj.centre(t), obj.colour_at(t), obj.shape_at(t))
                      for i, obj in enumerate(scene.objects) if obj.visible(t))
        if shown in painted:
            frames[t] = frames[painted[shown]]
            continue
        painted[shown] = t
        for obj in scene.objects:
            if obj.visible(t):
                _paint(frames[t], obj, t, scene.height, scene.width)
    if isinstance(scene, LongScene) and scene.distractor is not None:
        _paint_distractor(frames, scene)
    return np.clip(np.rint(frames), 0, 255).astype(np.uint8)


def _paint_distractor(frames: np.ndarray, scene: LongScene) -> None:
    y0, y1, x0, x1 = scene.distractor_box()
    yy, xx = np.mgrid[y0:y1, x0:x1]
    checker = ((yy - y0) // 3 + (xx - x0) // 3) % 2
    patch = np.where(checker[..., None] == 0, *(np.asarray(c, np.float32) for c in DISTRACTOR_COLOURS))
    for t in range(scene.num_frames):
        if scene.distractor_on(t):
            frames[t, y0:y1, x0:x1] = patch


def background(bg: Background, height: int, width: int) -> np.ndarray:
    """(H, W, 3) float32 background: a plain colour, or that colour under a few soft plane waves."""
    image = np.empty((height, width, 3), np.float32)
    image[:] = BACKGROUNDS[bg.colour]
    if bg.textured:
        rng = np.random.default_rng(bg.texture_seed)
        yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
        wave = np.zeros((height, width), np.float32)
        for _ in range(3):
            # 5-9 cycles across the frame: ripples of 12-22 pixels, so every 28-pixel video token shows some
            # (coarser blotches left "plain or textured" to a comparison across tokens, which the tiny model
            # often got wrong), yet soft and faint next to an object's edge.
            angle, cycles, phase = rng.uniform(0, np.pi), rng.uniform(5, 9), rng.uniform(0, 2 * np.pi)
            along = (np.cos(angle) * xx / width + np.sin(angle) * yy / height) * 2 * np.pi * cycles
            wave += np.sin(along + phase).astype(np.float32)
        tint = rng.uniform(0.6, 1.0, size=3).astype(np.float32)  # a faint hue, not just brightness
        image += (TEXTURE_AMPLITUDE / 3) * wave[..., None] * tint
    return image


def coverage(shape: str, dx: np.ndarray, dy: np.ndarray, r: float) -> np.ndarray:
    """Boolean inside-test for a shape of radius `r` centred at the origin; dx, dy in pixels."""
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "square":
        # 0.8 r half-side: about the area of the circle, so "large" means the same for every shape.
        return (np.abs(dx) <= 0.8 * r) & (np.abs(dy) <= 0.8 * r)
    if shape == "triangle":
        # Apex up at -r, base at +0.8 r with half-width r.
        return (dy <= 0.8 * r) & (np.abs(dx) <= (dy + r) / 1.8)
    if shape == "cross":
        arm = 0.3 * r
        ax, ay = np.abs(dx), np.abs(dy)
        return ((ax <= r) & (ay <= arm)) | ((ay <= r) & (ax <= arm))
    raise ValueError(f"unknown shape {shape!r}")


def _paint(frame: np.ndarray, obj: SceneObject, t: int, height: int, width: int) -> None:
    """Paints `obj` (a SceneObject or a long scene's TrackedObject) as it is in frame t."""
    cx, cy = obj.centre(t)
    cx, cy = cx * width, cy * height  # pixel units; pixel (i, j) covers [j, j+1) x [i, i+1)
    r = obj.radius * min(height, width)
    x0, x1 = max(0, int(np.floor(cx - r))), min(width, int(np.ceil(cx + r)))
    y0, y1 = max(0, int(np.floor(cy - r))), min(height, int(np.ceil(cy + r)))
    if x0 >= x1 or y0 >= y1:
        return
    offsets = (np.arange(SUPERSAMPLE) + 0.5) / SUPERSAMPLE
    xs = (np.arange(x0, x1)[:, None] + offsets).ravel() - cx
    ys = (np.arange(y0, y1)[:, None] + offsets).ravel() - cy
    inside = coverage(obj.shape_at(t), xs[None, :], ys[:, None], r)
    alpha = inside.reshape(y1 - y0, SUPERSAMPLE, x1 - x0, SUPERSAMPLE).mean(axis=(1, 3), dtype=np.float32)
    colour = np.asarray(COLOURS[obj.colour_at(t)], np.float32)
    patch = frame[y0:y1, x0:x1]
    patch += alpha[..., None] * (colour - patch)
