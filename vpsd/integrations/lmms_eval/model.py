"""`--model vpsd`: lmms-eval's chat-model interface over `vpsd.LLM`.

    python -m lmms_eval --model vpsd --model_args config=configs/world_qwen2_5_vl.yaml,method=hippo \
        --tasks vpsd_world --include_path examples/lmms_eval --output_path out/

Model args: `config` (a vpsd YAML), `method` (default hippo; `ar` is the baseline), `pruning`, `ratio`, `gamma`,
`batch` (the engine's continuous batch; lmms-eval's `--batch_size` when not given), `trace_dir`, `stats_dir` (where
the speed files go: default lmms-eval's results folder), and any `KEY=VALUE` setting (`decoding.seed=3`,
`target.device=cuda`), as a job's `--set`. Settings that cannot run are a `vpsd.ConfigError` before any model
loads, naming them.

`generate_until`: each request's document goes through the task's `doc_to_messages`; its one video and the
user's text (after the system message, if the task gives one) are the request (requests.py). Requests with equal
generation kwargs run through one `LLM.generate` call, so `batch > 1` batches them in the engine, each video's
requests next to each other (requests.py `generate_by_video`: the target reads and prefills a video once for all
its questions), answered in lmms-eval's order. A request vpsd cannot take, or whose video fails to read, is
answered with an empty string and a warning naming it: the evaluation goes on and scores it as wrong.
`loglikelihood` and the multi-round form are refused with a NotImplementedError saying why.

Data parallel (`accelerate launch` / `torchrun -m lmms_eval`): lmms-eval gives every rank its share of the
requests; each rank holds its own `vpsd.LLM`, on its own GPU (`cuda:LOCAL_RANK`: a config's bare `cuda` device is
the rank's) or on the CPU. vpsd starts no process group of its own (its parallel roles run on threads), so it
never touches lmms-eval's; the only collective here is the speed files' gather, in `clean()`, which lmms-eval
calls once on every rank after the last request (not in `generate_until`: a rank whose requests all came from
lmms-eval's response cache never calls it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from lmms_eval.api.model import lmms
from loguru import logger as eval_logger

import vpsd
from vpsd.integrations.lmms_eval.requests import (BadRequest, generate_by_video, group_key, request_seed,
                                                   sampling_params, video_request)
from vpsd.integrations.lmms_eval.speed import SpeedLog, speed_file

REFUSED = ("vpsd answers generate_until requests only: {kind} requests score given continuations by the "
           "target's log-likelihood, which involves no decoding and so nothing for speculative decoding to speed up "
           "(vpsd's outputs are the target's own). Run such tasks with the target's lmms-eval backend (e.g. "
           "--model qwen2_5_vl with the same checkpoint).")


class VpsdLmms(lmms):
    """One `vpsd.LLM` for the whole evaluation; closed by lmms-eval's `clean()` after the last request."""

    is_simple = False  # a chat model: requests carry doc_to_messages

    def __init__(self, config: str, method: str = "hippo", pruning: str | None = None, ratio: float | None = None,
                 gamma: int | str | None = None, batch: int | None = None, batch_size: int | str | None = 1,
                 max_batch_size: int | None = None, device: str | None = None, stats_dir: str | None = None,
                 trace_dir: str | None = None, **settings: Any) -> None:
        super().__init__()
        self._rank = int(os.environ.get("RANK", "0"))
        self._world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self._device = _rank_device()
        if device is not None:  # lmms-eval's --device: where the models run (a bare "cuda" is the rank's own GPU)
            settings = {"target.device": device, "draft.device": device, **settings}
        engine_batch = int(batch) if batch is not None else _batch(batch_size)
        self.llm = vpsd.LLM(config, method, pruning=pruning, ratio=ratio, gamma=gamma, batch=engine_batch,
                            settings=settings, trace_dir=trace_dir)
        self.method = method
        self.batch_size_per_gpu = engine_batch
        self.results_dir = Path(stats_dir) if stats_dir else results_dir(sys.argv)
        self.speed = SpeedLog(method, {"config": str(config), "method": method, "pruning": pruning, "ratio": ratio,
                                       "gamma": gamma, "batch": engine_batch, **settings})
        self._warned: set[str] = set()
        self._cleaned = False

    # ---- what lmms-eval reads ---------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where lmms-eval's own collectives put their tensors (this rank's GPU under NCCL, else the CPU)."""
        return self._device

    @property
    def batch_size(self) -> int:
        return self.batch_size_per_gpu

    # ---- requests ---------------------------------------------------------------------------------------

    def generate_until(self, requests: list[Instance]) -> list[GenerationResult | str]:
        answers: list[GenerationResult | str] = [""] * len(requests)
        self._answer(requests, answers)
        return answers

    def _answer(self, requests: list[Instance], answers: list[GenerationResult | str]) -> None:
        groups: dict[str, list[int]] = {}
        for i, inst in enumerate(requests):
            if (inst.metadata or {}).get("__padding_only__"):
                continue  # lmms-eval's filler evening out the ranks' request counts: its answer is discarded
            groups.setdefault(group_key(inst.args[2]), []).append(i)
        repeats: Counter[str] = Counter()
        for idxs in groups.values():
            gen_kwargs = requests[idxs[0]].args[2]
            params, ignored = sampling_params(gen_kwargs)
            self._warn_once(f"generation kwargs {ignored} mean nothing to vpsd: ignored", bool(ignored))
            todo: list[tuple[int, vpsd.VideoRequest]] = []
            for i in idxs:
                _, doc_to_messages, _, doc_id, task, split = requests[i].args
                # The request's id seeds its draws (request_seed): the document's, the k-th repeat its own.
                rid = f"{task}:{split}:{doc_id}"
                repeats[rid] += 1
                rid += f"#{repeats[rid] - 1}" if repeats[rid] > 1 else ""
                try:
                    req = video_request(doc_to_messages(self.task_dict[task][split][doc_id]), rid)
                    todo.append((i, dataclasses.replace(req, seed=request_seed(self.llm.config.decoding.seed, rid))))
                except BadRequest as e:
                    self._failed(task, rid, f"BadRequest: {e}")
            started = time.perf_counter()
            # One video's questions together (its prefix prefilled once), answered in lmms-eval's order.
            outs = generate_by_video(lambda rs: self.llm.generate(rs, params), [r for _, r in todo]) if todo else []
            self.speed.add_wall({requests[i].args[4] for i, _ in todo}, time.perf_counter() - started)
            for (i, req), out in zip(todo, outs):
                task = requests[i].args[4]
                if out.error is not None:
                    self._failed(task, req.id, out.error)
                    continue
                answers[i] = GenerationResult(out.text, TokenCounts(output_tokens=out.num_generated_tokens))
                self.speed.add(task, {"id": req.id, "token_ids": out.token_ids, "stats": out.stats, "error": None})
                self.cache_hook.add_partial("generate_until", (requests[i].args[0], gen_kwargs), out.text)

    def _failed(self, task: str, rid: str, error: str) -> None:
        eval_logger.warning(f"vpsd: request {rid} answered empty: {error}")
        self.speed.add(task, {"id": rid, "token_ids": [], "stats": {}, "error": error})

    def _warn_once(self, message: str, when: bool = True) -> None:
        if when and message not in self._warned:
            self._warned.add(message)
            eval_logger.warning(f"vpsd: {message}")

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise NotImplementedError(REFUSED.format(kind="loglikelihood (multiple-choice)"))

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise NotImplementedError("vpsd answers one user turn with one video a request; multi-round tasks (each "
                                  "round seeing the previous answers) are not supported")

    def clean(self) -> None:
        """After the last request, on every rank: the speed files (every rank's rows gathered, written on rank 0),
        then the models freed (an LLM judge may need the memory next)."""
        if self._cleaned:
            return
        self._cleaned = True
        summaries = self.speed.write(self.results_dir)
        self.llm.close()
        super().clean()
        if self._rank == 0:
            for task, s in summaries.items():
                where = f" -> {speed_file(self.results_dir, task, self.method)}" if self.results_dir else ""
                vs = f", {s['speedup_vs_ar']:.2f}x ar's wall" if "speedup_vs_ar" in s else ""
                eval_logger.info(f"vpsd {self.method} on {task}: {s['items_done']} items, {s['tokens_per_s']:.1f} "
                                 f"tokens/s, MAT {s['mean_accepted_tokens']:.2f}{vs}{where}")


def results_dir(argv: list[str]) -> Path | None:
    """Where lmms-eval writes this run's `<date>_results.json`: `--output_path`, then the folder it names after
    the model (loggers/evaluation_tracker.py: a `pretrained=`, `path=`... model arg; none for vpsd's own), read
    from the command line as lmms-eval reads it. None without `--output_path`."""
    from lmms_eval.loggers.evaluation_tracker import GeneralConfigTracker
    from lmms_eval.utils import sanitize_model_name

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--output_path", default=None)
    parser.add_argument("--model_args", default="")
    args, _ = parser.parse_known_args(argv[1:])
    if not args.output_path:
        return None
    return Path(args.output_path) / sanitize_model_name(GeneralConfigTracker._get_model_name(args.model_args))


def _rank_device() -> torch.device:
    """This rank's GPU, made the current one so a bare `cuda` in the config is it; the CPU without GPUs."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _batch(batch_size: int | str | None) -> int:
    try:
        return int(batch_size or 1)
    except ValueError:
        raise vpsd.ConfigError([f"--batch_size {batch_size}: vpsd's engine batch is a number of items "
                                "(batch=N in model_args, or --batch_size N)"]) from None
