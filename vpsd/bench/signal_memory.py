"""Memory of the pruning signals at a real target's depth and a long video (issue 13, point 5).

A tiny-width Qwen2.5-VL language model with a real target's depth (28 layers, as Qwen2.5-VL-7B) prefills
a ~24k-token sequence (24 temporal groups of 32x32 merged video tokens + a question); for an attention
strategy (hippo) and for UV-Prune (parallelvlm) it reports, in MiB:

- capture: what the signal hooks hold on the target beyond the prefill's own KV cache (the attention mass
  scored layer by layer, hidden rows), measured as the bytes of the tensors they hold;
- wire: the bytes the target sends the pruner (signals_wire.pack);
- pruner: the pruner's peak RSS growth while it unpacks and scores them, in a fresh subprocess
  (resource.getrusage maxrss);
- and the same capture / wire accounting at Qwen2.5-VL-7B and -72B widths (from the formulas the
  measured numbers check), with the transient a layer's scoring adds on the target while it runs (that
  layer's keys widened to float32 and one chunk of 32 text queries' logits, freed before the next layer).

    vpsd bench signal_memory [--tokens-side 32 --groups 24]
Pointing PYTHONPATH at an older checkout measures that checkout's signals (the "before" figures).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from vpsd.config import PruningConfig
from vpsd.models.base import SequenceEmbeddings
from vpsd.models.registry import load_adapter
from vpsd.models.spec import ModelSpec
from vpsd.engine.pair_prefill import prefill_for_strategy
from vpsd.models.signals import text_positions
from vpsd.pipeline.layout import VideoTokenLayout
from vpsd.pipeline.pruning.strategies import STRATEGIES
from vpsd.roles.signals_wire import pack

MIB = 2**20
DEPTH = 28  # Qwen2.5-VL-7B's text layers
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=DEPTH, num_attention_heads=2,
            num_key_value_heads=1)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0])
# (layers, query heads, KV heads, head_dim, hidden) of the real targets, for the scaled accounting.
REAL = {"Qwen2.5-VL-7B": (28, 28, 4, 128, 3584), "Qwen2.5-VL-72B": (80, 64, 8, 128, 8192)}


def _bytes(value) -> int:
    if isinstance(value, (tuple, list)):
        return sum(_bytes(v) for v in value)
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _storages(value) -> set[int]:
    if isinstance(value, (tuple, list)):
        return set().union(*(_storages(v) for v in value)) if value else set()
    return {value.untyped_storage().data_ptr()} if isinstance(value, torch.Tensor) else set()


def sequence(adapter, groups: int, side: int, text: int = 24) -> SequenceEmbeddings:
    """Random embeddings of a prefix, groups x side x side video tokens and `text` question tokens."""
    prefix, n = 16, groups * side * side
    length = prefix + n + text
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, length, adapter.model.config.get_text_config().hidden_size, generator=gen)
    embeds = embeds.to(adapter.model.dtype)
    layout = VideoTokenLayout.from_grid(torch.arange(prefix, prefix + n), (groups, side, side))
    positions = torch.arange(length).view(1, 1, length).expand(3, 1, length).contiguous()
    return SequenceEmbeddings(embeds=embeds, positions=positions, next_position=length, layout=layout)


def pruner_peak(path: Path, strategy: str) -> float:
    """Peak RSS growth (MiB) of a fresh process that unpacks the saved wire tensors and scores them."""
    # Linux: writing 5 to clear_refs resets the peak (VmHWM) to the current RSS, so the figure is the
    # growth from the received tensors to the highest point of unpacking and scoring.
    code = f"""
import torch
from vpsd.pipeline.pruning.strategies import STRATEGIES
from vpsd.roles.signals_wire import unpack
torch.set_num_threads(1)
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
tag, tensors = torch.load({str(path)!r})
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
signals, layout = unpack(tag, tensors)
STRATEGIES[{strategy!r}].select(signals, layout, 0.9, 0)
print(status("VmHWM") - before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def scaled(strategy: str, tokens: int, text: int, dims, layers_read: int | None) -> tuple[float, float, float]:
    """(capture, wire, per-layer transient) MiB at a real width in bf16, by the accounting this checkout uses."""
    depth, hq, hkv, d, hidden = dims
    bf16 = 2
    if strategy == "uv":
        rows = 2 if _uv_rows_two() else min(20, depth) + 1
        hidden_bytes = rows * (tokens + text) * hidden * bf16
        return hidden_bytes / MIB, hidden_bytes / MIB, 0.0
    n = depth if layers_read is None else min(layers_read, depth)
    seq = tokens + text
    if _scored_on_target():
        mass = n * hkv * tokens * 4
        transient = hkv * seq * d * 4 + hq * min(text, 32) * seq * 4 + hq * text * d * bf16
        return mass / MIB, mass / MIB, transient / MIB
    queries = n * hq * text * d * bf16
    keys = n * hkv * tokens * d * bf16
    stack_copy = keys if _keys_stacked() else 0
    return (queries + stack_copy) / MIB, (queries + keys) / MIB, 0.0


def _scored_on_target() -> bool:
    from vpsd.models.signals import PrefillSignals

    return "video_attention" in PrefillSignals.__dataclass_fields__


def _uv_rows_two() -> bool:
    import inspect

    from vpsd.models import signals

    return "uv_layers" in inspect.getsource(signals)


def _keys_stacked() -> bool:
    import inspect

    from vpsd.models import signals

    return "torch.stack(value)" in inspect.getsource(signals.PrefillSignals.as_tensors)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpsd bench signal_memory", description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=24)
    p.add_argument("--tokens-side", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--strategies", nargs="+", default=["hippo", "uv"])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    spec = ModelSpec(tiny={"seed": 0, "text": TEXT, "vision": VISION}, dtype=args.dtype)
    adapter = load_adapter("qwen2_5_vl", spec)
    emb = sequence(adapter, args.groups, args.tokens_side)
    nt = len(text_positions(emb))
    print(f"{emb.layout.num_tokens} video tokens, {emb.seq_len} in all, {DEPTH} layers, hidden {TEXT['hidden_size']}")
    for strategy in args.strategies:
        pruning = PruningConfig(strategy, 0.9)
        try:
            layers_read = pruning.signal_layers(parallel=True)
            pre = prefill_for_strategy(adapter, emb, pruning, parallel=True)
        except AttributeError:  # an older checkout: pruning.layers (20) was the only setting
            layers_read = pruning.layers
            pre = prefill_for_strategy(adapter, emb, pruning)
        cache = _storages([layer.keys for layer in pre.state.cache.layers] + [layer.values for layer in pre.state.cache.layers])
        held = {f: v for f, v in vars(pre.signals).items() if isinstance(v, (torch.Tensor, tuple))}
        capture = sum(_bytes(v) for v in held.values() if not (_storages(v) & cache))
        sent = pre.signals.as_tensors()
        stacked = sum(_bytes(v) for v in sent.values() if not (_storages(v) & cache) and not (_storages(v) & _storages(list(held.values()))))
        base = {"visual_embeds": emb.visual_embeds.float()} if STRATEGIES[strategy].needs_visual_embeds else {}
        tag, tensors = pack({**base, **sent}, emb.layout)
        wire = sum(_bytes(t) for t in tensors)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "wire.pt"
            torch.save((tag, [t.clone() for t in tensors]), path)
            del pre, sent, tensors
            peak = pruner_peak(path, strategy)
        print(f"{strategy:6s} measured ({args.dtype}, tiny width): capture {(capture + stacked) / MIB:8.1f} MiB "
              f"(of which a stacked copy {stacked / MIB:.1f}), wire {wire / MIB:8.1f} MiB, pruner peak {peak:8.1f} MiB")
        for name, dims in REAL.items():
            c, w, t = scaled(strategy, emb.layout.num_tokens, nt, dims, layers_read)
            print(f"{'':6s} {name} (bf16, same tokens): capture {c:9.1f} MiB, wire {w:9.1f} MiB"
                  + (f", per-layer transient {t:.1f} MiB" if t else ""))
    print(f"target process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
