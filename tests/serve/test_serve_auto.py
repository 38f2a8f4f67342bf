"""`vpsd serve --method auto` (issue 63, item 2): a config `vpsd tune` wrote is served with its choice at the batch
asked, the startup line says which, and the answers equal `ar`'s through the Python API."""

from __future__ import annotations

import pytest

import vpsd
from tests.serve.test_serve import running_server
from tests.unit.test_tune_config import TINY, tuned

openai = pytest.importorskip("openai")

VIDEO = TINY.parents[1] / "examples" / "world" / "videos" / "world-001000.mp4"
PROMPT = "Describe the video."
MAX_TOKENS = 12


def test_serve_method_auto_serves_the_tuned_choice_and_answers_as_ar(tmp_path):
    config = tuned(tmp_path)  # sd at batch 1 (in process), hippo at batch 8
    with vpsd.LLM(TINY, method="ar") as llm:
        expected = llm.generate(vpsd.VideoRequest(str(VIDEO), PROMPT),
                                vpsd.SamplingParams(max_new_tokens=MAX_TOKENS))[0].text
    log = tmp_path / "server.log"
    server = running_server(log, ["--config", str(config), "--method", "auto", "--batch", "1",
                                  "--allowed-media-dir", str(VIDEO.parent)], 120)
    proc = next(server)
    try:
        client = openai.OpenAI(base_url=f"{proc.base}/v1", api_key="none", max_retries=0, timeout=60)
        answer = client.chat.completions.create(
            model=config.stem, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT},
                                                   {"type": "video_url", "video_url": {"url": str(VIDEO)}}]}])
        assert answer.choices[0].message.content == expected
        assert "--method auto: sd" in log.read_text()  # the choice at the batch asked, said at startup
    finally:
        next(server, None)  # the fixture's end: the server killed
