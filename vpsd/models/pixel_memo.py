"""A video's pixel tensors and their hash, made once for all the questions about it (issue 62).

Every question about a video prepares its pixels again (models/qwen2_5_vl.py `_prepare_qwen`: resized,
normalized, cut into patches) and the prefix cache hashes them again to find its key (engine/prefix_cache.py
`video_key`). On the long world that was 27 ms and 18 ms of a reused question's ~100 ms prefill (a 64-frame 720p
video at Qwen's pixel budget is ~0.4 GB of float32 patches: ~0.3 s each, estimated). The frame cache
(video/frame_cache.py) hands every question about a video the very same read-only frames array, so an adapter
keeps the tensors it made from the last such array, and their digests once a prefix cache asked for them (a video
asked once is never hashed), and a later question about it takes them as they are.

Kept only for read-only frames (the frame cache's: nothing can change them in place; a caller's own writable
array is prepared every time), one video an adapter (a video's questions come together: the coordinator hands
them to one pipeline in a row), no larger than `budget` bytes (the frame cache's, `reuse.frames_mib`, set by the
engine and the draft rank beside their frame caches: 0 keeps nothing), and only while the frames live: when the
frame cache drops them and no request holds them, the entry goes with them (`weakref.finalize`). Counted in the
memory plan beside the frame cache (launch/memory.py: the budget again, a model that embeds).

Lossless: the tensors are what preparing the same pixels again would make (the same deterministic ops), and a
tensor's digest is the hash `video_key` would compute from its bytes (`tensor_digest`), so a memoized request
and a prepared one have the same key.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from typing import Callable, Hashable

import numpy as np
import torch


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    """A hash of one pixel tensor as the model sees it: its name, dtype, shape and bytes."""
    t = tensor.detach().to("cpu").contiguous()
    h = hashlib.blake2b(digest_size=20)
    h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.digest()


# named pixel tensors; their digests (one dict for every question of the video: hashed once, when first asked);
# whether they were kept from the video's last question
Made = tuple[dict[str, torch.Tensor], dict[str, bytes], bool]


class PixelMemo:
    """The pixel tensors an adapter made from the last read-only frames array it prepared (module docstring)."""

    def __init__(self, budget: int = 0) -> None:
        self._lock = threading.Lock()
        self._making = threading.Lock()
        self._entry: tuple[weakref.ref, Hashable, Made] | None = None
        self.budget = budget  # bytes an entry may hold; 0: none is kept
        self.hits = 0

    def __deepcopy__(self, memo: dict) -> "PixelMemo":
        return PixelMemo(self.budget)  # a copied model keeps nothing of this one's

    def tensors(self, frames: np.ndarray, key: Hashable, make: Callable[[], dict[str, torch.Tensor]]) -> Made:
        """`make()`'s tensors for `frames` (and `key`: what else they depend on), their digests' dict, and whether
        they were kept from the last call on the same read-only array and key; else they are made (and kept when
        `frames` is read-only and they fit the budget). The digests are computed only if a prefix cache asks
        (`video_key`, into the dict every question of the video shares): a video asked once is never hashed."""
        if frames.flags.writeable or self.budget <= 0:
            return make(), {}, False  # never kept
        # One read-only video prepared at a time: a question prepared on the prefill-ahead thread while the same
        # video's previous question is still being prepared on the engine's waits for it, then takes its tensors.
        with self._making:
            with self._lock:
                entry = self._entry
                if entry is not None and entry[0]() is frames and entry[1] == key:
                    self.hits += 1
                    return entry[2]
            tensors = make()
            if sum(t.nbytes for t in tensors.values()) > self.budget:
                return tensors, {}, False
            digests: dict[str, bytes] = {}  # filled by the first video_key that hashes them, shared with later ones
            ref = weakref.ref(frames)
            with self._lock:
                self._entry = (ref, key, (tensors, digests, True))
            weakref.finalize(frames, self._drop, ref)
            return tensors, digests, False

    def _drop(self, ref: weakref.ref) -> None:
        with self._lock:
            if self._entry is not None and self._entry[0] is ref:
                self._entry = None
