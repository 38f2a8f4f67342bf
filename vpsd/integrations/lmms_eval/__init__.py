"""vpsd as an lmms-eval model backend: `python -m lmms_eval --model vpsd --model_args config=C,method=hippo ...`.

Registered through lmms-eval's entry-point group `lmms_eval.models` (pyproject.toml: `vpsd = ...:manifest`), so
lmms-eval finds it with no fork and no plugin variable. lmms-eval imports the entry point on every start, for
any model: this module imports nothing but lmms-eval's manifest type, and that only when called.

  model.py     the backend: `VpsdLmms`, lmms-eval's chat-model interface over `vpsd.LLM`
  requests.py  a task document's chat messages and generation kwargs as a VideoRequest and SamplingParams (pure)
  speed.py     the per-task speed file beside lmms-eval's results (MAT, tokens/s, speedup against `ar`)
"""

from __future__ import annotations

MODEL_ID = "vpsd"
MODEL_CLASS = "vpsd.integrations.lmms_eval.model.VpsdLmms"


def manifest():
    """The entry point's payload: lmms-eval's ModelManifest naming the chat backend (lmms_eval imported here,
    lazily: it is lmms-eval that calls this)."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL_ID, chat_class_path=MODEL_CLASS)
