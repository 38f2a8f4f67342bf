"""Frames that are pictures already: a folder of frame images, and a frames file (.npz).

Both are read under the rules a video file is (`vpsd.video.sampling`), and scaled as asked: a folder's images by
swscale as each is converted (its default filter), to the first image's size or the size asked for; a frames
file's by `resize_frames` (torch's antialiased bicubic), as frames handed over in memory are
(`vpsd.video.item.scale_to_max_side`), so the two ways the Python API's frames travel give the same pixels.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np

from vpsd.video.clip import VideoClip
from vpsd.video.errors import VideoError
from vpsd.video.folder import IMAGE_SUFFIXES, frame_files, read_image
from vpsd.video.frames import max_side_size
from vpsd.video.info import VideoInfo
from vpsd.video.resize import resize_frames
from vpsd.video.sampling import select_indices


def folder_files(folder: Path) -> list[Path]:
    files = frame_files(folder)
    if not files:
        raise VideoError("empty", folder, f"folder holds no frame images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return files


def read_folder(folder: Path, folder_fps: float, request: dict, shape: dict) -> VideoClip:
    files = folder_files(folder)
    indices = select_indices(len(files), folder_fps, **request)
    first = read_image(files[int(indices[0])])
    # Images are scaled as they are converted (swscale's default filter): every image to the first one's
    # size, or to the size asked for.
    size = shape["size"] or max_side_size(*first.shape[:2], shape["max_side"])
    if size != first.shape[:2]:
        first = read_image(files[int(indices[0])], size=size)
    decoded = {int(indices[0]): first}
    for i in np.unique(indices[1:]).tolist():
        if i not in decoded:
            decoded[i] = read_image(files[i], size=size)
    return VideoClip(
        frames=np.stack([decoded[i] for i in indices.tolist()]),
        fps=float(folder_fps),
        timestamps=indices / float(folder_fps),
        source_num_frames=len(files),
        duration_s=len(files) / float(folder_fps),
        indices=indices,
        read_mode="folder",
        frames_decoded=len(decoded),
    )


FRAMES_SUFFIX = ".npz"


def write_frames_file(path: Path, frames: np.ndarray, times: np.ndarray) -> None:
    """Frames already decoded, as `read_video` reads them back (uncompressed: written and read once)."""
    np.savez(path, frames=np.ascontiguousarray(frames, dtype=np.uint8), times=np.asarray(times, dtype=np.float64))


def load_frames_file(path: Path) -> tuple[np.ndarray, np.ndarray, float]:
    """(frames, times, their mean rate) of a frames file; VideoError when it is not one."""
    try:
        with np.load(path, allow_pickle=False) as data:
            frames, times = data["frames"], np.asarray(data["times"], dtype=np.float64)
    except (OSError, ValueError, KeyError) as err:
        raise VideoError("corrupt", path, f"not a frames file (.npz with frames and times): {err}") from None
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or times.shape != (len(frames),):
        raise VideoError("corrupt", path, f"frames {frames.dtype} {tuple(frames.shape)} with times "
                         f"{tuple(times.shape)}: need (T, H, W, 3) uint8 and (T,)")
    if len(frames) == 0:
        raise VideoError("empty", path, "frames file holds no frames")
    span_s = float(times[-1] - times[0]) if len(times) > 1 else 0.0
    fps = (len(times) - 1) / span_s if span_s > 0 else 1.0  # for a request by rate: the frames' mean rate
    return frames, times, fps


def read_frames_file(path: Path, request: dict, shape: dict) -> VideoClip:
    frames, times, fps = load_frames_file(path)
    indices = select_indices(len(frames), fps, **request)
    kept = frames[indices]
    size = shape["size"] or max_side_size(*frames.shape[1:3], shape["max_side"])
    if size != frames.shape[1:3]:
        kept = resize_frames(kept, *size)
    return VideoClip(frames=kept, fps=fps, timestamps=times[indices], source_num_frames=len(frames),
                     duration_s=len(frames) / fps, indices=indices, read_mode="frames_file")



def stills_info(count: int, fps: float, height: int, width: int, codec: str) -> VideoInfo:
    """A folder's or a frames file's: every frame at hand, nothing to seek."""
    return VideoInfo(num_frames=count, fps=fps, duration_s=count / fps, height=height, width=width,
                     coded_height=height, coded_width=width, sample_aspect_ratio=Fraction(1), rotation=0,
                     codec=codec, keyframes=count, seekable=True, fallback_reason=None)
