"""Tiny models saved the way the published checkpoints are laid out (config.json, generation_config.json, a
video preprocessor config, a tokenizer with a chat template), which is what vpsd requires of a `path:` spec."""

from __future__ import annotations

import json
from pathlib import Path

SYSTEM = "You are a careful video analyst."
# A Qwen-style template with a non-default system turn: the rendered prompt must carry it.
QWEN_TEMPLATE = (
    "{% for m in messages %}{% if loop.first %}<|im_start|>system\n" + SYSTEM + "<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{% if c['type'] == 'video' %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAVA_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {% for c in m['content'] %}{% if c['type'] == 'video' %}"
    "<video>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MEAN, STD = [0.3, 0.4, 0.5], [0.2, 0.25, 0.3]


def save_official(adapter, out: Path, processor: dict, template: str, max_shard_size: str | None = None) -> Path:
    """max_shard_size: the weights in several safetensors files and an index, as large checkpoints are."""
    adapter.model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    adapter.model.generation_config.save_pretrained(out)
    tok = adapter.tokenizer
    previous = tok.chat_template
    tok.chat_template = template
    try:
        tok.save_pretrained(out)
    finally:
        tok.chat_template = previous
    (out / "video_preprocessor_config.json").write_text(json.dumps(processor))
    return out


def _qwen_processor(adapter, **over) -> dict:
    vc = adapter.model.config.vision_config
    f = vc.patch_size * vc.spatial_merge_size
    return {"patch_size": vc.patch_size, "merge_size": vc.spatial_merge_size,
            "temporal_patch_size": vc.temporal_patch_size, "image_mean": MEAN, "image_std": STD,
            "size": {"shortest_edge": 4 * f * f, "longest_edge": 4 * f * f}, "fps": 1.0, **over}


def official_checkpoint(adapter, family: str, out: Path, max_shard_size: str | None = None) -> Path:
    """`adapter`'s model saved in the official layout with its own processor settings (test_grow and others)."""
    if family == "llava_onevision":
        side = adapter.model.config.vision_config.image_size
        return save_official(adapter, out, {"size": {"height": side, "width": side}, "image_mean": MEAN,
                                            "image_std": STD}, LLAVA_TEMPLATE, max_shard_size)
    return save_official(adapter, out, _qwen_processor(adapter), QWEN_TEMPLATE, max_shard_size)
