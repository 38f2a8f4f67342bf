"""`vpsd serve`: an OpenAI-compatible HTTP server over vpsd's Python API (docs/serving.md).

    cli.py      the command: settings, startup refusals, uvicorn, SIGTERM
    app.py      the routes (FastAPI): chat completions (plain and streamed), models, health, metrics; errors
    schema.py   OpenAI's chat-completions request, response, chunk and error shapes (pydantic)
    media.py    a request's messages as one prompt and one video, within the limits
    batcher.py  the queue and the one engine thread that owns the `vpsd.LLM`
    metrics.py  Prometheus metrics

It sits on top beside the launcher: only the `vpsd` command imports it, and it imports vpsd only through the
Python API (vpsd.api) and the tokenizer's lock. FastAPI, uvicorn and prometheus-client are the `serve` extra.
"""
