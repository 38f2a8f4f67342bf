"""A forward's cost with transformers' own cache and attention (DynamicCache, sdpa: the cache grows by
concatenation and grouped-query heads are expanded by copies) against vpsd's (models/kv_cache.GrowingCache, which
grows in place, and models/attention, which attends without per-head copies), on one randomly initialised
Qwen2.5-VL text model, in one process, interleaved per shape; outputs compared.

    python scripts/cache_cost.py HIDDEN,LAYERS,HEADS,KV_HEADS,HEAD_DIM,INTERMEDIATE
    python scripts/cache_cost.py 768,12,16,8,48,2048     # the grown long-world target (configs/world_long_scaled.yaml)

Per shape (batch B, context L, rows k): the median of 6 forwards after a chunked prefill, each rolled back."""
import sys, time, torch
from transformers import DynamicCache, Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel
from vpsd.models.kv_cache import GrowingCache
from vpsd.models.attention import NAME
torch.set_num_threads(1); torch.manual_seed(0)
h,l,nh,kv,hd,inter = map(int, sys.argv[1].split(","))
half=hd//2; sec=[half-2*(half*3//8), half*3//8, half*3//8]
cfg = Qwen2_5_VLConfig(text_config=dict(vocab_size=600, hidden_size=h, num_hidden_layers=l, num_attention_heads=nh,
    num_key_value_heads=kv, head_dim=hd, intermediate_size=inter, rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=sec),
    max_position_embeddings=32768, bos_token_id=None, eos_token_id=None, pad_token_id=0)).text_config
cfg._attn_implementation="sdpa"
m = Qwen2_5_VLTextModel(cfg).eval()
def run(kind, B, L, k, reps=6):
    cfg._attn_implementation = "sdpa" if kind=="old" else NAME
    cache = DynamicCache(config=cfg) if kind=="old" else GrowingCache(cfg)
    g=torch.Generator().manual_seed(1)
    with torch.no_grad():
        for s in range(0, L, 1024):
            n=min(1024,L-s); pos=torch.arange(s,s+n).view(1,1,n).expand(3,B,n)
            kw = {} if B==1 else {"attention_mask": torch.ones(B, s+n, dtype=torch.long)}
            m(input_ids=torch.randint(0,600,(B,n),generator=g), position_ids=pos, past_key_values=cache, use_cache=True, **kw)
        ts=[]; out=None
        for _ in range(reps):
            pos=torch.arange(L,L+k).view(1,1,k).expand(3,B,k)
            kw = {} if B==1 else {"attention_mask": torch.ones(B, L+k, dtype=torch.long)}
            ids=torch.randint(0,600,(B,k),generator=torch.Generator().manual_seed(2))
            t=time.perf_counter(); out=m(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, **kw).last_hidden_state; ts.append(time.perf_counter()-t)
            cache.crop(-k)
    ts.sort(); return ts[len(ts)//2]*1000, out
for B,L,k in [(1,1000,1),(1,4000,1),(1,4000,8),(8,2000,1),(8,2000,8)]:
    a,oa=run("old",B,L,k); b,ob=run("new",B,L,k)
    print(f"B={B} L={L} k={k}: old {a:.1f} ms  new {b:.1f} ms  ({a/b:.2f}x)  max|diff| {(oa-ob).abs().max().item():.2e}", flush=True)
