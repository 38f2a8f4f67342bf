"""vpsd from Python, on the embedded pair as shipped: hippo over three example videos, checked against `ar`.

    python examples/python_api.py            (from the repository root, after scripts/setup.sh)
"""

import vpsd

VIDEOS = [f"examples/world/videos/world-00100{i}.mp4" for i in range(3)]
requests = [vpsd.VideoRequest(path, "Describe the video.") for path in VIDEOS]
params = vpsd.SamplingParams(max_new_tokens=64)

with vpsd.LLM("configs/world_qwen2_5_vl.yaml", method="hippo") as llm:
    outs = llm.generate(requests, params)
with vpsd.LLM("configs/world_qwen2_5_vl.yaml", method="ar") as llm:
    ref = llm.generate(requests, params)

for out, base in zip(outs, ref):
    assert out.token_ids == base.token_ids, "hippo's output differs from ar's"
    print(f"{out.id}: {out.text!r} (MAT {out.stats['mean_accepted_tokens']:.2f}, "
          f"decode {out.stats['decode_s']:.2f} s against ar's {base.stats['decode_s']:.2f} s)")
