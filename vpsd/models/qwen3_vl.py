"""Qwen3-VL adapter: timestamped video prompt, per-frame M-RoPE groups, deepstack pruned with the video.

What differs from Qwen2.5-VL (see qwen2_5_vl.py for what is shared):
- Vision: 16 px patches (merge 2, temporal 2: sides are multiples of 32), normalised with mean = std = 0.5.
- Prompt: every temporal group of video tokens is its own block preceded by its time in text,
  `<0.2 seconds><|vision_start|><|video_pad|>*n<|vision_end|><1.2 seconds><|vision_start|>...`,
  replacing the chat template's single `<|vision_start|><|video_pad|><|vision_end|>`, as the reference
  processor (transformers 4.57, qwen-vl-utils, vLLM) does. transformers 5's processor replaces only the
  `<|video_pad|>` and so leaves an extra start/end pair around the whole video; positions are the same
  either way, the text is not, and the checkpoints were trained on the reference form.
  Video tokens stay frame-major, row-major, so the layout is still the plain token grid.
- Positions: time is carried by the timestamps, not by the rotary phase. `get_rope_index` splits the
  video grid into one (1, h, w) grid per temporal group, each group's block starting where the
  preceding text ends; there is no `second_per_grid_ts`.
- Deepstack: the vision tower also returns features of a few intermediate layers, added to the video
  tokens' hidden states after the first decoder layers. They are rows per video token, so a pruned
  prefill passes only the kept tokens' rows and a mask over the kept sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from vpsd.models.base import SequenceEmbeddings, VideoInputs, VideoLMAdapter, VisionFeatures
from vpsd.models.prompt import Turn, chatml, slotted, turns_of
from vpsd.models.qwen2_5_vl import QwenAdapterMixin, qwen_token_ids
from vpsd.models.qwen_video import QwenVisionSpec

if TYPE_CHECKING:  # the config class is imported where it is built
    from transformers import Qwen3VLConfig

DEFAULT_FPS = 2.0  # Qwen3VLVideoProcessor's sampling rate; sets the timestamps when none are given
IMAGENET_STANDARD = (0.5, 0.5, 0.5)  # Qwen3VLVideoProcessor's image_mean and image_std
VIDEO_BLOCK = "<|vision_start|><|video_pad|><|vision_end|>"  # what the chat template renders for a video


def qwen3_vision_spec(patch_size: int = 16, merge_size: int = 2, temporal_patch_size: int = 2) -> QwenVisionSpec:
    """Qwen3-VL's video preprocessing: its patch sizes and normalisation, per-frame pixel bounds in units of 32x32."""
    factor = patch_size * merge_size
    return QwenVisionSpec(
        patch_size=patch_size,
        merge_size=merge_size,
        temporal_patch_size=temporal_patch_size,
        mean=IMAGENET_STANDARD,
        std=IMAGENET_STANDARD,
        min_pixels=4 * factor * factor,
        max_pixels=768 * factor * factor,  # the processor's max_video_tokens per frame
    )


def group_timestamps(frame_times: np.ndarray, temporal_patch_size: int) -> list[float]:
    """Seconds shown before each temporal group: the mean of its first and last frame's times.

    An incomplete last group is padded with the last frame, as the frames themselves are.
    """
    times = [float(t) for t in frame_times]
    times += [times[-1]] * (-len(times) % temporal_patch_size)
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def qwen3_video_text(timestamps: list[float], tokens_per_group: int) -> str:
    """The expansion of one video: a timestamp and a start/end-delimited block per temporal group."""
    block = "<|vision_start|>" + "<|video_pad|>" * tokens_per_group + "<|vision_end|>"
    return "".join(f"<{t:.1f} seconds>{block}" for t in timestamps)


def qwen3_chat_prompt(prompt: str, video_text: str) -> str:
    """Qwen3-VL's chat template (no default system turn) for one user turn: the video, then the prompt."""
    return qwen3_chat_template([Turn("user", prompt, True)]).replace(VIDEO_BLOCK, video_text, 1)


def qwen3_chat_template(turns: list[Turn]) -> str:
    """Qwen3-VL's chat template over a conversation, hand-written (models/prompt.py chatml; no default system turn),
    with the chat template's single VIDEO_BLOCK for the family to expand."""
    return chatml(turns, VIDEO_BLOCK)


class Qwen3VLAdapter(QwenAdapterMixin, VideoLMAdapter):
    family = "qwen3_vl"
    default_vision_spec = staticmethod(qwen3_vision_spec)
    default_fps = DEFAULT_FPS

    def prepare(self, frames: np.ndarray, prompt: str, frame_times: np.ndarray | None = None) -> VideoInputs:
        """frame_times: (T,) seconds of each frame in the source video (see VideoLMAdapter.prepare)."""
        texts, text, extra = self._chat(frames.shape[0], prompt, frame_times)
        return self._prepare_qwen(frames, texts, text, **extra)

    def _chat(self, num_frames: int, prompt: str, frame_times: np.ndarray | None
              ) -> tuple[list[str], Callable[[tuple[int, int, int]], str], dict[str, torch.Tensor]]:
        """The conversation's texts and its template as a function of the token grid (the time in the prompt)."""
        stamps = group_timestamps(self.frame_times(num_frames, frame_times), self.vision_spec.temporal_patch_size)
        turns = turns_of(prompt)  # a question or a conversation (models/prompt.py); its texts go in as text
        chat = self.render_chat(slotted(turns), VIDEO_BLOCK) or qwen3_chat_template(slotted(turns))

        def text(grid: tuple[int, int, int]) -> str:
            return chat.replace(VIDEO_BLOCK, qwen3_video_text(stamps, grid[1] * grid[2]), 1)

        return [t.text for t in turns], text, {}

    @torch.inference_mode()
    def embed(self, inputs: VideoInputs) -> SequenceEmbeddings:
        return self.embed_with(inputs, self.vision_features(inputs))

    @torch.inference_mode()
    def embed_with(self, inputs: VideoInputs, features: VisionFeatures | None) -> SequenceEmbeddings:
        embeds = self._embed_tokens(inputs, features)
        # One (N_video, D) tensor per deepstack layer, rows in video token order (none without features: a
        # prefill that feeds no video row, engine/prefix_cache.py).
        deepstack = [] if features is None else [layer.to(embeds.dtype) for layer in features.deepstack]
        positions, next_position = self._rope(inputs, with_seconds=False)  # the grid only: no tower
        return SequenceEmbeddings(
            embeds=embeds,
            positions=positions.to(self.device),
            next_position=next_position,
            layout=inputs.layout,
            deepstack=deepstack,
        )

    def _span_kwargs(self, emb: SequenceEmbeddings, start: int, end: int) -> dict[str, Any]:
        """Deepstack rows of the video tokens in [start, end), where the span holds any (`prefill_span`)."""
        seq_positions = emb.layout.seq_positions.to(emb.embeds.device)
        inside = (seq_positions >= start) & (seq_positions < end)
        if not bool(inside.any()):
            return {}
        if not emb.deepstack:
            raise ValueError("a span with video tokens needs the vision features (deepstack)")
        is_video = torch.zeros(end - start, dtype=torch.bool, device=seq_positions.device)
        is_video[seq_positions[inside] - start] = True
        return {"visual_pos_masks": is_video.unsqueeze(0),
                "deepstack_visual_embeds": [layer[inside.to(layer.device)] for layer in emb.deepstack]}

    def _language_kwargs(self, emb: SequenceEmbeddings, kept_video: torch.Tensor) -> dict[str, Any]:
        """Deepstack rows of the kept video tokens and where they sit in the fed (text + kept video) sequence."""
        seq_positions = emb.layout.seq_positions.to(emb.embeds.device)
        kept_video = kept_video.to(seq_positions.device)
        is_video = torch.zeros(emb.seq_len, dtype=torch.bool, device=seq_positions.device)
        is_video[seq_positions] = True
        fed = ~is_video
        fed[seq_positions[kept_video]] = True
        return {
            "visual_pos_masks": is_video[fed].unsqueeze(0),  # (1, L_fed)
            "deepstack_visual_embeds": [layer[kept_video] for layer in emb.deepstack],  # each (N_kept, D)
        }


def tiny_config(text: dict, vision: dict, tokenizer) -> "Qwen3VLConfig":
    """A Qwen3-VL config of any size; the special token ids come from the tokenizer."""
    from transformers import Qwen3VLConfig

    head_dim = text.pop("head_dim", text["hidden_size"] // text["num_attention_heads"])
    half = head_dim // 2
    # Interleaved M-RoPE: height / width each take every third frequency of their section, the
    # temporal row the rest (Qwen3-VL's [24, 20, 20] for head_dim 128, scaled to head_dim).
    hw = half * 5 // 16
    mrope = text.pop("mrope_section", [half - 2 * hw, hw, hw])
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            head_dim=head_dim,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=mrope, mrope_interleaved=True),
            max_position_embeddings=32768,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **text,
        ),
        vision_config=dict(out_hidden_size=text["hidden_size"], **vision),
        **qwen_token_ids(tokenizer),
        tie_word_embeddings=False,
    )
