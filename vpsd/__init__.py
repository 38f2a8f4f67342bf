"""vpsd: lossless, parallel speculative decoding for video-LLMs.

From Python: `vpsd.LLM`, `vpsd.SamplingParams`, `vpsd.VideoRequest` (vpsd/api.py; imported on first use, so that a
rank importing a submodule does not pay for the model stack). As a job: `./torchrun.sh run ...` (vpsd/launch).

Layers (imports only point down this list, and no module reaches itself through others: tests/unit/test_layering.py):
  integrations/ vpsd in other programs (lmms-eval) -> api; imported by those programs alone
  api.py      the Python API                       -> launch (its wiring, below the I/O)
  launch/     torchrun entry, CLI, manifests       -> roles, models, transport, pipeline
  roles/      one module per rank role             -> engine, models, transport, pipeline
  engine/     the one decode loop and its drafters -> models, pipeline
  decoders/   the oracle: reference decoders, one  -> engine (an item's prefill), models, pipeline;
              item at a time (tests, launch/lossless.py and `vpsd grow` check against them)
  transport/  ZeroMQ control + torch.distributed   -> pipeline (messages)
  models/     one adapter per video-LLM family     -> pipeline (layout)
  pipeline/   the pure core: no I/O, no models
"""

__version__ = "0.1.0"

_API = ("LLM", "SamplingParams", "VideoRequest", "Output", "ConfigError", "VideoError", "RanksFailed")


def __getattr__(name: str):
    if name in _API:
        from vpsd import api

        return getattr(api, name)
    raise AttributeError(f"module 'vpsd' has no attribute {name!r}")
