"""Qwen2.5-VL adapter: hand-built video tensors, M-RoPE (3-D rotary) positions and rope deltas.

Qwen lays the video out as grid_t x (grid_h/2) x (grid_w/2) merged tokens, frame-major, with frames
paired by the temporal patch (2). Positions come from the model's own `get_rope_index` with
`mm_token_type_ids` (without them the model silently falls back to 1-D positions).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from vpsd.models.base import SequenceEmbeddings, VideoInputs, VideoLMAdapter, VisionFeatures
from vpsd.models.prompt import Turn, chatml, encode_chat, slotted, turns_of
from vpsd.models.qwen_video import QwenVisionSpec, qwen_video_tensors, resize_for_qwen
from vpsd.video.resize import smart_resize
from vpsd.pipeline.layout import VideoTokenLayout

if TYPE_CHECKING:  # the config class is imported where it is built
    from transformers import Qwen2_5_VLConfig

VIDEO_TYPE_ID = 2  # mm_token_type_ids: text 0, image 1, video 2
QWEN_VIDEO_BLOCK = "<|vision_start|><|video_pad|><|vision_end|>"  # what Qwen's chat templates render for a video
DEFAULT_FPS = 2.0  # Qwen's default video sampling rate: the frames' times when none are given
QWEN_SYSTEM = "You are a helpful assistant."  # Qwen2.5-VL's template's system turn when a conversation has none


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
    return qwen_chat_template([Turn("user", prompt, True)], video)


def qwen_chat_template(turns: list[Turn], video_block: str = QWEN_VIDEO_BLOCK) -> str:
    """Qwen2.5-VL's chat template over a conversation, hand-written (models/prompt.py chatml): its default system
    turn when the conversation has none, then each message, the video before its turn's text."""
    return chatml(turns, video_block, default_system=QWEN_SYSTEM)


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

    def frame_times(self, num_frames: int, frame_times: np.ndarray | None) -> np.ndarray:
        """(T,) seconds of each frame: as given, else sampled at the family's default rate from time 0."""
        if frame_times is None or not self.use_frame_times:
            return np.arange(num_frames) / self.fps
        times = np.asarray(frame_times, dtype=np.float64)
        if times.shape != (num_frames,) or not np.all(np.isfinite(times)) or np.any(np.diff(times) < 0):
            raise ValueError(f"frame_times must be {num_frames} finite non-decreasing seconds, got {times!r}")
        return times

    def token_grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """(groups, rows, columns) of merged video tokens for `num_frames` frames of height x width: the grid
        `_prepare_qwen` gets from the pixels (resized to multiples of the patch, frames padded to the temporal
        patch), known from the sizes alone."""
        spec = self.vision_spec
        h, w = smart_resize(height, width, factor=spec.factor, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
        return -(-num_frames // spec.temporal_patch_size), h // spec.factor, w // spec.factor

    def count_tokens(self, num_frames: int, height: int, width: int, prompt: str,
                     frame_times: np.ndarray | None = None) -> int:
        """The length of the sequence `prepare` makes, from the frames' count and size alone (no pixel is read:
        a long video's fit to the context is decided before it is decoded, launch/items.py)."""
        texts, text, _ = self._chat(num_frames, prompt, frame_times)
        groups, rows, columns = self.token_grid(num_frames, height, width)
        # Each video pad is one control token: the template is tokenized with one a group (an hour at fps 4 is
        # millions of pads, half a minute to tokenize) and the rest of each group's counted.
        return len(encode_chat(self.tokenizer, text((groups, 1, 1)), texts)) + groups * (rows * columns - 1)

    def _prepare_qwen(
        self, frames: np.ndarray, texts: list[str], chat_text: Callable[[tuple[int, int, int]], str],
        **pixel_extra: torch.Tensor,
    ) -> VideoInputs:
        """Video tensors, then `chat_text(token_grid)` (the family's template with the video tokens expanded and
        slot(i) for the conversation's texts[i]) tokenized with the texts as text (encode_chat) and checked against
        the grid; `pixel_extra` joins the pixel inputs."""
        spec = self.vision_spec

        def video() -> dict[str, torch.Tensor]:
            pixel_values, grid = qwen_video_tensors(resize_for_qwen(frames, spec), spec)
            return {"pixel_values_videos": pixel_values.to(self.model.dtype), "video_grid_thw": grid}

        # a video's later questions take the pixels its first prepared (models/pixel_memo.py)
        tensors, digests, kept = self.pixel_memo.tensors(frames, (spec, self.model.dtype), video)
        grid = tensors["video_grid_thw"]
        t, h, w = (int(v) for v in grid[0])
        token_grid = (t, h // spec.merge_size, w // spec.merge_size)
        n = token_grid[0] * token_grid[1] * token_grid[2]
        input_ids = torch.tensor([encode_chat(self.tokenizer, chat_text(token_grid), texts)], dtype=torch.long)
        is_video = input_ids[0] == self.model.config.video_token_id
        if int(is_video.sum()) != n:
            raise ValueError(f"tokenizer produced {int(is_video.sum())} video tokens, expected {n}")
        layout = VideoTokenLayout.from_grid(torch.nonzero(is_video).squeeze(1), token_grid)
        pixel_inputs = {
            **tensors,
            "mm_token_type_ids": torch.where(is_video, VIDEO_TYPE_ID, 0).to(torch.int32).unsqueeze(0),
            **pixel_extra,
        }
        return VideoInputs(input_ids=input_ids, pixel_inputs=pixel_inputs, layout=layout, digests=digests,
                           pixels_kept=kept)

    def _embed_video(self, inputs: VideoInputs) -> tuple[torch.Tensor, Any]:
        """Token embeddings with the vision tower's merged video features in place; and the tower's output."""
        device = self.device
        p = inputs.pixel_inputs
        embeds = self.model.model.get_input_embeddings()(inputs.input_ids.to(device))
        feats = self.model.model.get_video_features(p["pixel_values_videos"].to(device), p["video_grid_thw"].to(device))
        embeds[0, inputs.layout.seq_positions.to(device)] = torch.cat(list(feats.pooler_output)).to(embeds.dtype)
        return embeds, feats

    @torch.inference_mode()
    def vision_features(self, inputs: VideoInputs) -> VisionFeatures:
        """The vision tower's merged video features (and Qwen3-VL's deepstack rows), in video token order."""
        p = inputs.pixel_inputs
        device = self.device
        feats = self.model.model.get_video_features(p["pixel_values_videos"].to(device), p["video_grid_thw"].to(device))
        deepstack = getattr(feats, "deepstack_features", None)  # Qwen3-VL's; none in Qwen2.5-VL
        return VisionFeatures(torch.cat(list(feats.pooler_output)),
                              [] if deepstack is None else [torch.cat(list(layer)) for layer in deepstack])

    def _embed_tokens(self, inputs: VideoInputs, features: VisionFeatures | None) -> torch.Tensor:
        """Token embeddings with the video features in place (`_embed_video`'s, from features already computed)."""
        device = self.device
        embeds = self.model.model.get_input_embeddings()(inputs.input_ids.to(device))
        if features is not None:
            embeds[0, inputs.layout.seq_positions.to(device)] = features.video.to(embeds.dtype)
        return embeds

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
        """prompt: a question or a conversation (models/prompt.py); its texts go in as text (encode_chat)."""
        texts, text, extra = self._chat(frames.shape[0], prompt, frame_times)
        return self._prepare_qwen(frames, texts, text, **extra)

    def _chat(self, num_frames: int, prompt: str, frame_times: np.ndarray | None
              ) -> tuple[list[str], Callable[[tuple[int, int, int]], str], dict[str, torch.Tensor]]:
        """The conversation's texts, its template as a function of the token grid, and the pixel inputs' extras."""
        fps = sampled_fps(self.frame_times(num_frames, frame_times)) or self.fps
        turns = turns_of(prompt)
        chat = self.render_chat(slotted(turns), QWEN_VIDEO_BLOCK) or qwen_chat_template(slotted(turns))

        def text(grid: tuple[int, int, int]) -> str:
            n = grid[0] * grid[1] * grid[2]
            return chat.replace(QWEN_VIDEO_BLOCK, QWEN_VIDEO_BLOCK.replace("<|video_pad|>", "<|video_pad|>" * n))

        # Time is in the rotary phase: the temporal position of group g is
        # int(g * second_per_grid_ts * tokens_per_second), so the spacing must be the clip's own.
        return [t.text for t in turns], text, {
            "second_per_grid_ts": torch.tensor([self.vision_spec.temporal_patch_size / fps])}

    @torch.inference_mode()
    def embed(self, inputs: VideoInputs) -> SequenceEmbeddings:
        return self.embed_with(inputs, self.vision_features(inputs))

    @torch.inference_mode()
    def embed_with(self, inputs: VideoInputs, features: VisionFeatures | None) -> SequenceEmbeddings:
        embeds = self._embed_tokens(inputs, features)
        positions, next_position = self._rope(inputs, with_seconds=True)  # the grid and times: no tower
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
