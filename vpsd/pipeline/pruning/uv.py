"""ParallelVLM's UV-Prune score (Eq. 2-3): how much a video token's alignment with the text grows
through the target's early layers.

S^l_ij = cos(V_i^l, X_j^l) for video token i and text token j at layer l, and
dS_i = sum_j sum_{l=1..L} (S^l_ij - S^{l-1}_ij), signed as in the paper: a token whose alignment rises
ranks high, one whose alignment stays flat or falls ranks low (Sec. 4.1), so no absolute value.
Layer 0 is the input of the first decoder layer (hidden_states[0] in transformers), L = 20 by default
(Appendix D) or all the layers given if fewer.

The inner sum telescopes: sum_{l=1..L} (S^l - S^{l-1}) = S^L - S^0, and sum_j cos(v, x_j) = v_hat . sum_j
x_hat_j. We compute that closed form: it is the same number, costs O(N D) instead of O(L N Nt), and
means the target only has to ship hidden states at layers 0 and L to the pruner.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

UV_DEFAULT_LAYERS = 20


def _text_alignment(video: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """sum_j cos(video_i, text_j) for every i: (Nv, D), (Nt, D) -> (Nv,)."""
    text_dir = F.normalize(text.float(), dim=-1).sum(0)  # (D,)
    return F.normalize(video.float(), dim=-1) @ text_dir


def uv_score(
    # (K, Nv, D) hidden states of the video tokens, row 0 = layer 0 (the input); rows 0 and
    # min(num_layers, K-1) are read: the target ships K = 2 (layers 0 and L), a full stack works too.
    video_hidden: torch.Tensor,
    text_hidden: torch.Tensor,  # (K, Nt, D) hidden states of the text tokens, same layers
    num_layers: int = UV_DEFAULT_LAYERS,
) -> torch.Tensor:  # (Nv,) float32
    last = min(num_layers, video_hidden.shape[0] - 1)
    return _text_alignment(video_hidden[last], text_hidden[last]) - _text_alignment(video_hidden[0], text_hidden[0])
