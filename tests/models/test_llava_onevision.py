"""LLaVA-OneVision specifics: config ids, the prompt, and a video token layout that matches the model's features.

The generic adapter contract (prefill, pruned prefill, decode, rollback) is in test_adapters.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import LlavaOnevisionProcessor

from tests.conftest import random_frames, tiny_pair
from vpsd.models.llava_onevision import llava_chat_prompt


def test_tiny_config_takes_ids_from_the_tokenizer_and_unties_the_head():
    target, draft = tiny_pair("llava_onevision")
    tok = target.tokenizer
    for adapter in (target, draft):
        cfg = adapter.model.config
        assert cfg.video_token_id == tok.convert_tokens_to_ids("<video>")
        assert cfg.image_token_id == tok.convert_tokens_to_ids("<image>")
        assert (cfg.vision_feature_layer, cfg.vision_feature_select_strategy) == (-1, "full")
        assert not cfg.tie_word_embeddings
        head, emb = adapter.model.lm_head.weight, adapter.model.model.language_model.embed_tokens.weight
        assert head.data_ptr() != emb.data_ptr()


def test_chat_prompt_follows_the_checkpoint_template():
    # transformers' test_processing_llava_onevision.test_chat_template expects this for the 7B checkpoint's
    # template with an image; a video renders the same with <video> in place of <image>.
    expected = "<|im_start|>user\n<video>\nWhat is shown in this image?<|im_end|>\n<|im_start|>assistant\n"
    assert llava_chat_prompt("What is shown in this image?", 1) == expected


def test_video_token_count_matches_the_official_processor():
    target, _ = tiny_pair("llava_onevision")
    vc = target.model.config.vision_config
    frames = random_frames(0, t=3)
    inputs = target.prepare(frames, "Describe the video.")
    # The processor's own count (T * ceil(g/2)^2 + 1), given its num_image_tokens = g^2 patches per frame.
    official = LlavaOnevisionProcessor._get_num_multimodal_tokens(
        SimpleNamespace(num_image_tokens=(vc.image_size // vc.patch_size) ** 2), video_sizes=[frames.shape[:3]]
    )
    assert inputs.layout.num_tokens == official["num_video_tokens"][0]
    prompt = llava_chat_prompt("Describe the video.", official["num_video_tokens"][0])
    assert target.tokenizer.decode(inputs.input_ids[0]) == prompt


def test_layout_says_where_the_model_puts_each_pooled_token():
    """Replace the projector output by (frame, patch row, patch col) and read the coordinates back after pooling."""
    target, _ = tiny_pair("llava_onevision")
    vc = target.model.config.vision_config
    g = vc.image_size // vc.patch_size
    inputs = target.prepare(random_frames(1, t=3), "Describe the video.")
    layout = inputs.layout
    t, p, _ = layout.grid

    def coordinates(module, args, out):
        coords = torch.zeros_like(out)  # (T, g*g, D)
        patch = torch.arange(g * g)
        coords[..., 0] = torch.arange(out.shape[0]).view(-1, 1).to(out.dtype)
        coords[..., 1] = (patch // g).to(out.dtype)
        coords[..., 2] = (patch % g).to(out.dtype)
        return coords

    handle = target.model.model.multi_modal_projector.register_forward_hook(coordinates)
    try:
        visual = target.embed(inputs).visual_embeds
    finally:
        handle.remove()

    grid = layout.prunable
    # Bilinear resizing (align_corners=False) maps a linear ramp to the source coordinate of each output cell.
    def source(i):
        return (i.float() + 0.5) * g / p - 0.5

    torch.testing.assert_close(visual[grid, 0], layout.frame[grid].float())
    torch.testing.assert_close(visual[grid, 1], source(layout.row[grid]))
    torch.testing.assert_close(visual[grid, 2], source(layout.col[grid]))
    assert layout.grid == (3, p, p) and layout.num_prunable == t * p * p
    # One newline, last, after every frame: not prunable, no grid cell.
    assert layout.num_tokens == t * p * p + 1
    assert torch.equal(torch.nonzero(~grid).squeeze(1), torch.tensor([t * p * p]))
    assert (layout.frame[-1], layout.row[-1], layout.col[-1]) == (-1, -1, -1)
    torch.testing.assert_close(visual[-1], target.model.model.image_newline.detach())


def test_changing_one_frame_changes_only_that_frames_tokens():
    target, _ = tiny_pair("llava_onevision")
    frames = random_frames(2)
    other = frames.copy()
    other[2] = random_frames(3, t=1)[0]
    a = target.embed(target.prepare(frames, "Describe the video.")).visual_embeds
    b = target.embed(target.prepare(other, "Describe the video.")).visual_embeds
    changed = (a - b).abs().amax(dim=1) > 0
    layout = target.prepare(frames, "Describe the video.").layout
    assert torch.equal(changed, layout.frame == 2)


def test_pruned_prefill_keeps_the_newline():
    target, _ = tiny_pair("llava_onevision")
    inputs = target.prepare(random_frames(4), "Describe the video.")
    layout = inputs.layout
    sel = target.kept_sequence_positions(layout, inputs.seq_len, torch.tensor([0, 5]))
    assert int(layout.seq_positions[-1]) in sel.tolist()
    assert sel.numel() == inputs.seq_len - layout.num_tokens + 3


def test_frames_of_any_size_are_resized_to_the_tower():
    target, _ = tiny_pair("llava_onevision")
    size = target.model.config.vision_config.image_size
    inputs = target.prepare(random_frames(5, t=2, h=40, w=72), "Describe the video.")
    assert inputs.pixel_inputs["pixel_values_videos"].shape == (1, 2, 3, size, size)
    p = inputs.layout.grid[1]
    assert inputs.layout.num_tokens == 2 * p * p + 1


def test_target_and_draft_share_tokens_and_layout():
    target, draft = tiny_pair("llava_onevision")
    frames = random_frames(6)
    a, b = target.prepare(frames, "Describe the video."), draft.prepare(frames, "Describe the video.")
    assert torch.equal(a.input_ids, b.input_ids)
    for name in ("seq_positions", "frame", "row", "col", "prunable"):
        assert torch.equal(getattr(a.layout, name), getattr(b.layout, name))
    torch.testing.assert_close(a.pixel_inputs["pixel_values_videos"], b.pixel_inputs["pixel_values_videos"])
