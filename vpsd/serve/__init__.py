"""`vpsd serve`: an OpenAI-compatible HTTP server over vpsd's Python API (docs/serving.md).

    cli.py      the command: settings, startup refusals, uvicorn, SIGTERM
    app.py      the routes (FastAPI): chat completions (plain and streamed), models, health, metrics; errors
    schema.py   OpenAI's chat-completions request, response, chunk and error shapes (pydantic)
    media.py    a request's messages as one prompt and one video, within the limits
    jobs.py     the bounded queue of requests between the handlers and the one engine thread
    online.py   continuous batching fed from the queue, text streamed per round (methods decoding in process)
    on_ranks.py requests submitted to a parallel method's child ranks as they arrive, each answered as it ends
    stream_text.py  a streamed request's text as it commits, never past a stop string's cut
    metrics.py  Prometheus metrics

It sits on top beside the launcher: only the `vpsd` command imports it. It builds on the Python API (vpsd.api: the
`LLM` loads the models and resolves the settings) and, for continuous batching, on the same engine wiring the API
and the job use (launch/wiring.py); it imports no role. FastAPI, uvicorn and prometheus-client are the `serve` extra.
"""
