"""Qwen2.5-VL adapter: hand-built video tensors, M-RoPE (3-D rotary) positions and rope deltas.

Qwen lays the video out as grid_t x (grid_h/2) x (grid_w/2) merged tokens, frame-major, with frames
paired by the temporal patch (2). Positions come from the model's own `get_rope_index` with
`mm_token_type_ids` (without them the model silently falls back to 1-D positions).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from vpsd.models.base import SequenceEmbeddings, VideoInputs, VideoLMAdapter
from vpsd.models.prompt import PROMPT_SLOT, encode_chat
from vpsd.models.qwen_video import QwenVisionSpec, qwen_video_tensors, resize_for_qwen
from vpsd.pipeline.layout import VideoTokenLayout

if TYPE_CHECKING:  # the config class is imported where it is built
    from transformers import Qwen2_5_VLConfig

VIDEO_TYPE_ID = 2  # mm_token_type_ids: text 0, image 1, video 2
QWEN_VIDEO_BLOCK = "<|vision_start|><|video_pad|><|vision_end|>"  # what Qwen's chat templates render for a video
DEFAULT_FPS = 2.0  # Qwen's default video sampling rate: the frames' times when none are given


def sampled_fps(frame_times: np.ndarray) -> float | None:
    """The rate at which the clip's frames were taken: (T - 1) / (last time - first time).

    From where the frames really are, so `num_frames` sampling of a long video (one frame every
    few seconds) and `fps` sampling give the model the true spacing. Qwen2.5-VL takes one spacing
    per video (`second_per_grid_ts`), so unevenly spaced frames (rounded `linspace` indices, a
    variable-rate source) get their mean spacing. transformers' processor uses
    frames / source duration instead (VideoMetadata.sampled_fps), which for `num_frames` sampling
    is off by (T - 1) / T of the span it covers; the frame times are the better measure of it.
    None when the clip spans no time (one frame, or every frame the same instant)."""
    times = np.asarray(frame_times, dtype=np.float64)
    span = float(times[-1] - times[0]) if len(times) > 1 else 0.0
    return (len(times) - 1) / span if span > 0 else None


def qwen_chat_prompt(prompt: str, num_video_tokens: int) -> str:
    """The Qwen chat template with the video placeholder expanded, as the official processor does."""
    video = "<|vision_start|>" + "<|video_pad|>" * num_video_tokens + "<|vision_end|>"
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{video}{prompt}<|im_end|>\n<|im_start|>assistant\n"
    )


class QwenAdapterMixin:
    """What the Qwen families share: construction, video preparation, video features, positions.

    A family sets `default_vision_spec` (its spec from the checkpoint's patch, merge and temporal patch
    sizes) and `default_fps`, and renders its own prompt around the video tokens (`_prepare_qwen`).
    """

    default_vision_spec: Callable[[int, int, int], QwenVisionSpec]
    default_fps: float
    vision_spec: QwenVisionSpec
    model: torch.nn.Module
    tokenizer: object

    def __init__(
        self,
        model,
        tokenizer,
        vision_spec: QwenVisionSpec | None = None,
        fps: float | None = None,
        use_frame_times: bool = True,
    ):
        """fps: the rate frames are taken as sampled at when no times are given. use_frame_times=False
        always does so, ignoring the clip's real times: for a checkpoint trained that way (the world
        pair, training/world_short.py, was trained with frames taken as 2 fps whatever their real spacing)."""
        super().__init__(model, tokenizer)
        vc = model.config.vision_config
        sizes = (vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size)
        self.vision_spec = vision_spec or type(self).default_vision_spec(*sizes)
        self.fps = self.default_fps if fps is None else fps
        self.use_frame_times = use_frame_times

    @property
    def position_rows(self) -> int:
        return 3  # M-RoPE: temporal, height, width

    def frame_times(self, frames: np.ndarray, frame_times: np.ndarray | None) -> np.ndarray:
        """(T,) seconds of each frame: as given, else sampled at the family's default rate from time 0."""
        if frame_times is None or not self.use_frame_times:
            return np.arange(frames.shape[0]) / self.fps
        times = np.asarray(frame_times, dtype=np.float64)
        if times.shape != (frames.shape[0],) or not np.all(np.isfinite(times)) or np.any(np.diff(times) < 0):
            raise ValueError(f"frame_times must be {frames.shape[0]} finite non-decreasing seconds, got {times!r}")
        return times

    def _prepare_qwen(
        self, frames: np.ndarray, prompt: str, chat_text: Callable[[tuple[int, int, int]], str],
        **pixel_extra: torch.Tensor,
    ) -> VideoInputs:
        """Video tensors, then `chat_text(token_grid)` (the family's template with the video tokens expanded and
        PROMPT_SLOT for the prompt) tokenized with `prompt` as text (encode_chat) and checked against the grid;
        `pixel_extra` joins the pixel inputs."""
        spec = self.vision_spec
        pixel_values, grid = qwen_video_tensors(resize_for_qwen(frames, spec), spec)
        t, h, w = (int(v) for v in grid[0])
        token_grid = (t, h // spec.merge_size, w // spec.merge_size)
        n = token_grid[0] * token_grid[1] * token_grid[2]
        input_ids = torch.tensor([encode_chat(self.tokenizer, chat_text(token_grid), prompt)], dtype=torch.long)
        is_video = input_ids[0] == self.model.config.video_token_id
        if int(is_video.sum()) != n:
            raise ValueError(f"tokenizer produced {int(is_video.sum())} video tokens, expected {n}")
        layout = VideoTokenLayout.from_grid(torch.nonzero(is_video).squeeze(1), token_grid)
        pixel_inputs = {
            "pixel_values_videos": pixel_values.to(self.model.dtype),
            "video_grid_thw": grid,
            "mm_token_type_ids": torch.where(is_video, VIDEO_TYPE_ID, 0).to(torch.int32).unsqueeze(0),
            **pixel_extra,
        }
        return VideoInputs(input_ids=input_ids, pixel_inputs=pixel_inputs, layout=layout)

    def _embed_video(self, inputs: VideoInputs) -> tuple[torch.Tensor, Any]:
        """Token embeddings with the vision tower's merged video features in place; and the tower's output."""
        device = self.device
        p = inputs.pixel_inputs
        embeds = self.model.model.get_input_embeddings()(inputs.input_ids.to(device))
        feats = self.model.model.get_video_features(p["pixel_values_videos"].to(device), p["video_grid_thw"].to(device))
        embeds[0, inputs.layout.seq_positions.to(device)] = torch.cat(list(feats.pooler_output)).to(embeds.dtype)
        return embeds, feats

    def _rope(self, inputs: VideoInputs, with_seconds: bool) -> tuple[torch.Tensor, int]:
        p = inputs.pixel_inputs
        kwargs = {"second_per_grid_ts": p["second_per_grid_ts"]} if with_seconds else {}
        positions, deltas = self.model.model.get_rope_index(
            inputs.input_ids,
            mm_token_type_ids=p["mm_token_type_ids"],
            video_grid_thw=p["video_grid_thw"],
            **kwargs,
        )
        return positions, int(positions.max()) + 1


class Qwen2_5_VLAdapter(QwenAdapterMixin, VideoLMAdapter):
    family = "qwen2_5_vl"
    default_vision_spec = QwenVisionSpec  # CLIP normalisation; patch sizes from the checkpoint
    default_fps = DEFAULT_FPS

    def prepare(self, frames: np.ndarray, prompt: str, frame_times: np.ndarray | None = None) -> VideoInputs:
        fps = sampled_fps(self.frame_times(frames, frame_times)) or self.fps
        chat = self.render_chat(PROMPT_SLOT, QWEN_VIDEO_BLOCK)  # the prompt goes in as text (encode_chat)

        def text(grid: tuple[int, int, int]) -> str:
            n = grid[0] * grid[1] * grid[2]
            if chat is None:
                return qwen_chat_prompt(PROMPT_SLOT, n)
            return chat.replace(QWEN_VIDEO_BLOCK, QWEN_VIDEO_BLOCK.replace("<|video_pad|>", "<|video_pad|>" * n))

        return self._prepare_qwen(
            frames,
            prompt,
            text,
            # Time is in the rotary phase: the temporal position of group g is
            # int(g * second_per_grid_ts * tokens_per_second), so the spacing must be the clip's own.
            second_per_grid_ts=torch.tensor([self.vision_spec.temporal_patch_size / fps]),
        )

    @torch.inference_mode()
    def embed(self, inputs: VideoInputs) -> SequenceEmbeddings:
        embeds, _ = self._embed_video(inputs)
        positions, next_position = self._rope(inputs, with_seconds=True)
        return SequenceEmbeddings(
            embeds=embeds, positions=positions.to(self.device), next_position=next_position, layout=inputs.layout
        )


def qwen_token_ids(tokenizer) -> dict[str, int]:
    """The Qwen vision placeholder and chat token ids a model config needs, read from the tokenizer."""
    ids = tokenizer.convert_tokens_to_ids
    return dict(
        video_token_id=ids("<|video_pad|>"),
        image_token_id=ids("<|image_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def tiny_config(text: dict, vision: dict, tokenizer) -> "Qwen2_5_VLConfig":
    """A Qwen2.5-VL config of any size; the special token ids come from the tokenizer."""
    from transformers import Qwen2_5_VLConfig

    head_dim = text.get("head_dim", text["hidden_size"] // text["num_attention_heads"])
    half = head_dim // 2
    # M-RoPE splits the rotary half-dimension into temporal / height / width sections (sum = head_dim / 2).
    mrope = text.pop("mrope_section", [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8])
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            head_dim=head_dim,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=mrope),
            max_position_embeddings=32768,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
            **text,
        ),
        vision_config=dict(out_hidden_size=text["hidden_size"], **vision),
        **qwen_token_ids(tokenizer),
    )
