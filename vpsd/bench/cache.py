"""A forward's cost with transformers' own cache and attention (DynamicCache, sdpa: the cache grows by
concatenation and grouped-query heads are expanded by copies) against vpsd's (models/kv_cache.GrowingCache, which
grows in place, and models/attention, which attends without per-head copies), on one randomly initialised
Qwen2.5-VL text model, in one process, interleaved per shape; outputs compared.

    vpsd bench cache HIDDEN,LAYERS,HEADS,KV_HEADS,HEAD_DIM,INTERMEDIATE
    vpsd bench cache 768,12,16,8,48,2048     # the grown long-world target (configs/world_long_scaled.yaml)

Per shape (batch B, context L, rows k): the median of 6 forwards after a chunked prefill, each rolled back."""
import sys
import time

import torch
from transformers import DynamicCache, Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

from vpsd.models.attention import NAME
from vpsd.models.kv_cache import GrowingCache

SHAPES = [(1, 1000, 1), (1, 4000, 1), (1, 4000, 8), (8, 2000, 1), (8, 2000, 8)]  # (batch, context, rows)


def text_model(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, intermediate: int):
    half = head_dim // 2
    sections = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    cfg = Qwen2_5_VLConfig(text_config=dict(
        vocab_size=600, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
        rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=sections),
        max_position_embeddings=32768, bos_token_id=None, eos_token_id=None, pad_token_id=0)).text_config
    cfg._attn_implementation = "sdpa"
    return Qwen2_5_VLTextModel(cfg).eval(), cfg


def forward(model, cache, ids: torch.Tensor, start: int) -> torch.Tensor:
    batch, n = ids.shape
    pos = torch.arange(start, start + n).view(1, 1, n).expand(3, batch, n)
    mask = {} if batch == 1 else {"attention_mask": torch.ones(batch, start + n, dtype=torch.long)}
    return model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, **mask).last_hidden_state


def run(model, cfg, vpsds: bool, batch: int, context: int, rows: int, reps: int = 6) -> tuple[float, torch.Tensor]:
    """(median ms of a `rows`-row forward after a `context`-token prefill, its output) on one cache and attention."""
    cfg._attn_implementation = NAME if vpsds else "sdpa"
    cache = GrowingCache(cfg) if vpsds else DynamicCache(config=cfg)
    g = torch.Generator().manual_seed(1)
    times, out = [], None
    with torch.no_grad():
        for start in range(0, context, 1024):  # chunked prefill
            forward(model, cache, torch.randint(0, 600, (batch, min(1024, context - start)), generator=g), start)
        for _ in range(reps):
            ids = torch.randint(0, 600, (batch, rows), generator=torch.Generator().manual_seed(2))
            t = time.perf_counter()
            out = forward(model, cache, ids, context)
            times.append(time.perf_counter() - t)
            cache.crop(-rows)
    times.sort()
    return times[len(times) // 2] * 1000, out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, cfg = text_model(*map(int, argv[0].split(",")))
    for batch, context, rows in SHAPES:
        theirs, a = run(model, cfg, False, batch, context, rows)
        ours, b = run(model, cfg, True, batch, context, rows)
        print(f"B={batch} L={context} k={rows}: transformers {theirs:.1f} ms  vpsd {ours:.1f} ms  "
              f"({theirs / ours:.2f}x)  max|diff| {(a - b).abs().max().item():.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
