"""Video input: decode files or frame folders into sampled RGB frames, and size them for a model.

Pure I/O, no models: `read_video` -> `VideoClip`, `resize_frames`, `smart_resize`, `normalized_frames`,
and `VideoError`, the only exception raised here.
"""

from vpsd.video.decode import VideoClip, read_video
from vpsd.video.errors import VideoError, VideoErrorKind
from vpsd.video.resize import normalized_frames, resize_frames, smart_resize

__all__ = ["VideoClip", "VideoError", "VideoErrorKind", "normalized_frames", "read_video", "resize_frames", "smart_resize"]
