"""vpsd: lossless, parallel speculative decoding for video-LLMs.

Layers (imports only point down this list):
  launch/     torchrun entry, CLI, manifests       -> roles, models, transport, pipeline
  roles/      one module per rank role             -> models, transport, pipeline
  decoders/   single-process reference decoders    -> models, pipeline
  transport/  ZeroMQ control + torch.distributed   -> pipeline (messages)
  models/     one adapter per video-LLM family     -> pipeline (layout)
  pipeline/   the pure core: no I/O, no models
"""

__version__ = "0.1.0"
