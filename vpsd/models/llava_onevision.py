"""LLaVA-OneVision adapter: square SigLIP frames, 2x2-pooled video tokens, one trailing newline, 1-D positions.

How transformers' `LlavaOnevisionModel.get_video_features` lays a video out (read in the installed source):
each frame, resized to the tower's square `image_size`, goes through SigLIP on its own; the selected hidden
layer is projected, reshaped to its (g, g) patch grid (g = image_size // patch_size) and bilinearly resized to
(ceil(g/2), ceil(g/2)) (`apply_pooling`); the frames are concatenated frame-major, row-major, and ONE
`image_newline` embedding is appended after the last frame. So a T-frame video is T * p * p + 1 video tokens
(p = ceil(g/2); 14 for the 384/14 checkpoints, 196 per frame), all `<video>` placeholders in the prompt.

Layout convention: the pooled tokens get (frame, row, col); the newline gets row = col = -1, frame = -1
(it belongs to the whole video, not to the last frame) and prunable = False, so a pruned prefill keeps it.
Positions are plain 1-D: token i sits at position i, as in the model's own forward without padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vpsd.models.base import SequenceEmbeddings, VideoInputs, VideoLMAdapter, VisionFeatures
from vpsd.models.prompt import Turn, chatml, encode_chat, slotted, turns_of
from vpsd.pipeline.layout import VideoTokenLayout
from vpsd.video import normalized_frames, resize_frames

if TYPE_CHECKING:  # the config class is imported where it is built
    from transformers import LlavaOnevisionConfig

# Every llava-hf OneVision checkpoint normalises with SigLIP's statistics (its processors were converted from
# google/siglip-so400m-patch14-384, as was LLaVA-NeXT's own SigLipImageProcessor). The transformers class default
# of LlavaOnevisionVideoProcessor is OpenAI CLIP's mean/std, which those checkpoint configs override.
SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class LlavaVisionSpec:
    image_size: int = 384  # frames are resized to image_size x image_size, aspect ratio not kept
    patch_size: int = 14
    mean: tuple[float, float, float] = SIGLIP_MEAN
    std: tuple[float, float, float] = SIGLIP_STD

    @property
    def pooled_side(self) -> int:
        """Side of a frame's token grid after the 2x2 bilinear pooling (ceil, as apply_pooling does)."""
        return math.ceil((self.image_size // self.patch_size) / 2)


def llava_chat_prompt(prompt: str, num_video_tokens: int) -> str:
    """The checkpoints' chat template (Qwen2 markers, no system turn) with `<video>` already expanded."""
    return llava_chat_template([Turn("user", prompt, True)], "<video>" * num_video_tokens)


def llava_chat_template(turns: list[Turn], video_block: str = "<video>") -> str:
    """The checkpoints' chat template over a conversation, hand-written (models/prompt.py chatml: no default system
    turn; a newline between the video and its turn's text)."""
    return chatml(turns, video_block, after_video="\n")


def llava_video_tensor(frames: np.ndarray, spec: LlavaVisionSpec) -> torch.Tensor:
    """(T, S, S, 3) uint8 frames at the tower's size -> pixel_values_videos (1, T, 3, S, S) float32.

    Exactly what the official video processor does after its resize: rescale by 1/255, then normalise per channel.
    """
    _, h, w, _ = frames.shape
    if (h, w) != (spec.image_size, spec.image_size):
        side = spec.image_size
        raise ValueError(f"frames are {h}x{w}, the vision tower takes {side}x{side}; resize first")
    return normalized_frames(frames, spec.mean, spec.std).unsqueeze(0).contiguous()


def llava_video_layout(seq_positions: torch.Tensor, num_frames: int, side: int) -> VideoTokenLayout:
    """Layout of T frames of side x side pooled tokens (frame-major, row-major) followed by one newline token."""
    n_grid = num_frames * side * side
    if seq_positions.numel() != n_grid + 1:
        raise ValueError(f"{seq_positions.numel()} video tokens, expected {num_frames}x{side}x{side} + 1 newline")
    ar = torch.arange(n_grid)
    minus_one = torch.tensor([-1])
    return VideoTokenLayout(
        seq_positions=seq_positions.long(),
        frame=torch.cat([ar // (side * side), minus_one]),
        row=torch.cat([(ar // side) % side, minus_one]),
        col=torch.cat([ar % side, minus_one]),
        prunable=torch.cat([torch.ones(n_grid, dtype=torch.bool), torch.zeros(1, dtype=torch.bool)]),
        grid=(num_frames, side, side),
    )


class LlavaOnevisionAdapter(VideoLMAdapter):
    family = "llava_onevision"

    def __init__(
        self,
        model,
        tokenizer,
        image_mean: tuple[float, float, float] = SIGLIP_MEAN,
        image_std: tuple[float, float, float] = SIGLIP_STD,
    ):
        super().__init__(model, tokenizer)
        vc = model.config.vision_config
        self.vision_spec = LlavaVisionSpec(
            image_size=vc.image_size, patch_size=vc.patch_size, mean=tuple(image_mean), std=tuple(image_std)
        )

    def prepare(self, frames: np.ndarray, prompt: str, frame_times: np.ndarray | None = None) -> VideoInputs:
        """frame_times is unused: LLaVA-OneVision's prompt and positions carry no time."""
        spec, size = self.vision_spec, self.vision_spec.image_size

        def video() -> dict[str, torch.Tensor]:
            pixel_values = llava_video_tensor(resize_frames(frames, size, size), spec)
            return {"pixel_values_videos": pixel_values.to(self.model.dtype)}

        # a video's later questions take the pixels its first prepared (models/pixel_memo.py)
        tensors, digests, kept = self.pixel_memo.tensors(frames, (spec, self.model.dtype), video)
        num_frames, side = frames.shape[0], spec.pooled_side
        n = num_frames * side * side + 1
        turns = turns_of(prompt)  # a question or a conversation (models/prompt.py); its texts go in as text
        chat = self.render_chat(slotted(turns), "<video>") or llava_chat_template(slotted(turns))
        template = chat.replace("<video>", "<video>" * n)
        input_ids = torch.tensor([encode_chat(self.tokenizer, template, [t.text for t in turns])], dtype=torch.long)
        is_video = input_ids[0] == self.model.config.video_token_id
        if int(is_video.sum()) != n:
            raise ValueError(f"tokenizer produced {int(is_video.sum())} video tokens, expected {n}")
        layout = llava_video_layout(torch.nonzero(is_video).squeeze(1), num_frames, side)
        return VideoInputs(input_ids=input_ids, pixel_inputs=dict(tensors), layout=layout, digests=digests,
                           pixels_kept=kept)

    def count_tokens(self, num_frames: int, height: int, width: int, prompt: str,
                     frame_times: np.ndarray | None = None) -> int:
        """The length of the sequence `prepare` makes, without pixels: every frame is resized to one square, so
        the size does not count."""
        n = num_frames * self.vision_spec.pooled_side ** 2 + 1
        turns = turns_of(prompt)
        chat = self.render_chat(slotted(turns), "<video>") or llava_chat_template(slotted(turns))
        # One <video> control token each: tokenized once, the others counted (a long video has hundreds of thousands).
        return len(encode_chat(self.tokenizer, chat, [t.text for t in turns])) + n - 1

    @torch.inference_mode()
    def embed(self, inputs: VideoInputs) -> SequenceEmbeddings:
        return self.embed_with(inputs, self.vision_features(inputs))

    @torch.inference_mode()
    def vision_features(self, inputs: VideoInputs) -> VisionFeatures:
        feats = self.model.model.get_video_features(inputs.pixel_inputs["pixel_values_videos"].to(self.device))
        return VisionFeatures(feats.pooler_output[0])  # (T * p * p + 1, D), newline last

    @torch.inference_mode()
    def embed_with(self, inputs: VideoInputs, features: VisionFeatures | None) -> SequenceEmbeddings:
        device = self.device
        ids = inputs.input_ids.to(device)
        embeds = self.model.model.get_input_embeddings()(ids)
        if features is not None:
            embeds[0, inputs.layout.seq_positions.to(device)] = features.video.to(embeds.dtype)
        length = inputs.seq_len  # 1-D positions: no tower
        positions = torch.arange(length, device=device).view(1, 1, length)
        return SequenceEmbeddings(embeds=embeds, positions=positions, next_position=length, layout=inputs.layout)


def tiny_config(text: dict, vision: dict, tokenizer) -> "LlavaOnevisionConfig":
    """A LLaVA-OneVision config of any size (Qwen2 text, SigLIP vision); special token ids come from the tokenizer.

    The feature layer and strategy are the real checkpoints' (-1, "full": SigLIP has no CLS token to drop).
    """
    from transformers import LlavaOnevisionConfig

    ids = tokenizer.convert_tokens_to_ids
    size = vision["image_size"]
    return LlavaOnevisionConfig(
        text_config=dict(
            model_type="qwen2",
            vocab_size=len(tokenizer),
            max_position_embeddings=32768,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
            **text,
        ),
        vision_config=dict(model_type="siglip_vision_model", vision_use_head=False, **vision),
        video_token_index=ids("<video>"),
        image_token_index=ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        image_grid_pinpoints=[[size, size]],  # images are unused; one pinpoint keeps the config consistent
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
