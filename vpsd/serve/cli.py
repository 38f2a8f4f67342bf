"""`vpsd serve`: load a model pair once and answer OpenAI chat completions over HTTP (docs/serving.md).

    vpsd serve --config configs/world_qwen2_5_vl.yaml --method hippo [--host 127.0.0.1] [--port 8000]
               [--api-key K | VPSD_API_KEY] [--batch N] [--allowed-media-dir D] [--pruning/--ratio/--gamma/--set]

Startup: the settings are checked and the models loaded (the parallel methods' ranks started) before the port
opens; a setting that cannot run is refused with the job's lines (exit 2), and so is a non-loopback --host
without an API key, unless --allow-insecure-host says so. SIGTERM or Ctrl-C: the port closes, the requests in
flight finish within --shutdown-timeout seconds (those still queued after it get 503), the ranks stop, exit 0.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _gamma(text: str) -> int | str:
    return text if text == "auto" else int(text)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vpsd serve", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the run's YAML (configs/)")
    p.add_argument("--method", default="hippo", help="any of vpsd's methods (default hippo; ar is the baseline), "
                                                      "or auto: the choice of a config `vpsd tune` wrote")
    p.add_argument("--pruning", default=None, help="override the method's pruning strategy")
    p.add_argument("--ratio", type=float, default=None, help="share of the video tokens pruned from the draft's input")
    p.add_argument("--gamma", type=_gamma, default=None, metavar="N|auto", help="draft tokens per chunk")
    p.add_argument("--batch", type=int, default=1, metavar="N",
                   help="requests decoding together, at most (the engine's or the child ranks' batch; others queue)")
    p.add_argument("--draft-on", choices=("rank", "thread"), default=None,
                   help="where a parallel method's draft and pruner run (default: child ranks)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="clients must send 'Authorization: Bearer KEY' (default: the VPSD_API_KEY variable, else none)")
    p.add_argument("--allow-insecure-host", action="store_true",
                   help="listen on a non-loopback --host without an API key")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the config's stem)")
    p.add_argument("--allowed-media-dir", type=Path, default=None,
                   help="video_url may name local files under this folder (default: none)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting at most; more get 429 (default 64)")
    p.add_argument("--max-body-mib", type=float, default=96.0, help="largest request body (default 96 MiB)")
    p.add_argument("--max-video-mib", type=float, default=64.0, help="largest video or frames of a request (64 MiB)")
    p.add_argument("--max-frames", type=int, default=512, help="most image_url frames in a request (default 512)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds the requests in flight get to finish on SIGTERM (default 30)")
    p.add_argument("--trace-dir", type=Path, default=None, help="structlog JSON traces of the engine (vpsd timeline)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import fastapi  # noqa: F401 - the serve extra, checked before any model loads
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"vpsd serve: {e.name} is not installed: pip install -e '.[serve]' (the serve extra)", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("VPSD_API_KEY") or None
    problem = _refusal(args, api_key)
    if problem is not None:
        print(f"vpsd serve: {problem}", file=sys.stderr)
        return 2
    import vpsd
    from vpsd.config import parse_overrides

    try:
        llm = vpsd.LLM(args.config, method=args.method, pruning=args.pruning, ratio=args.ratio, gamma=args.gamma,
                       batch=args.batch, draft_on=args.draft_on, settings=parse_overrides(args.set),
                       trace_dir=args.trace_dir)
    except vpsd.ConfigError as e:
        print(f"vpsd serve: refused:\n{e}", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="vpsd-serve-"))
    try:
        _serve(args, llm, api_key, scratch)
    finally:
        llm.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _refusal(args: argparse.Namespace, api_key: str | None) -> str | None:
    if not _is_loopback(args.host) and api_key is None and not args.allow_insecure_host:
        return (f"refusing to listen on {args.host} without an API key: anyone who reaches it could use the models "
                "and read what --allowed-media-dir holds. Give --api-key (or VPSD_API_KEY), or --allow-insecure-host")
    if args.batch < 1 or args.max_queue < 1:
        return "--batch and --max-queue must be >= 1"
    if args.allowed_media_dir is not None and not args.allowed_media_dir.is_dir():
        return f"--allowed-media-dir {args.allowed_media_dir} is not a folder"
    return None


def _serve(args: argparse.Namespace, llm, api_key: str | None, scratch: Path, how: str | None = None,
           started: Callable[[Callable[[int], None]], None] | None = None) -> None:
    """Serves until SIGTERM / Ctrl-C, then lets the requests in flight finish within the bound. Off the main thread
    (under torchrun, serve/launched.py) the signals are the caller's: `started` is handed the server's stop."""
    import uvicorn

    from vpsd.serve.app import ServeSettings, create_app
    from vpsd.serve.jobs import JobQueue
    from vpsd.serve.media import MediaLimits
    from vpsd.serve.metrics import Metrics
    from vpsd.serve.on_ranks import RanksRunner
    from vpsd.serve.online import OnlineEngine

    name = args.served_model_name or Path(args.config).stem
    settings = ServeSettings(model_name=name, method=llm.method.name, api_key=api_key,
                             max_body_bytes=int(args.max_body_mib * 2**20),
                             limits=MediaLimits(int(args.max_video_mib * 2**20), args.max_frames,
                                                args.allowed_media_dir), scratch=scratch)
    metrics = Metrics(name)
    tuned = getattr(llm, "tuned_choice", None)  # --method auto: the tuned config's choice, its batch included
    batch = llm.config.batching.size if tuned is not None else args.batch
    queue = JobQueue(args.max_queue, batch, metrics)
    # A parallel method's roles on child ranks: requests submitted to their batch as they arrive; else the engine in
    # this process, fed from the queue.
    runner = RanksRunner(llm, queue) if llm.served else OnlineEngine(llm, queue)
    app = create_app(llm, runner, settings, metrics)
    service = app.state.service

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:  # /health says 503 at once; new requests get 503
            service.closing = True
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=args.shutdown_timeout, access_log=False))
    if started is not None:
        started(lambda sig: server.handle_exit(sig, None))
    else:
        # uvicorn raises the signal again once it has shut down gracefully: with these, that ends main (exit 0)
        # instead of killing the process by the default handler (143) or a KeyboardInterrupt.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
    how = how or ("child ranks, continuous batching" if llm.served else "in process, continuous batching")
    what = f"--method auto: {tuned.describe()}" if tuned is not None else f"{llm.method.name}, batch {batch}"
    print(f"vpsd serve: {name} ({what}, {how}) on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        service.closing = True
        if not runner.close(grace_s=args.shutdown_timeout):
            print("vpsd serve: the requests in flight did not end in time; stopping them", file=sys.stderr)
