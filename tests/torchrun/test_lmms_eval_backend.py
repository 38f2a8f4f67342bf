"""vpsd as an lmms-eval backend (vpsd/integrations/lmms_eval) through the real lmms-eval, on the embedded world.

scripts/test_lmms_eval.sh installs lmms-eval beside vpsd and runs this file; where lmms_eval is not importable
(the main suite's venv) the module is skipped.

The local task is examples/lmms_eval/vpsd_world.yaml: the eight clips of examples/world/manifest.jsonl.
- `--model vpsd` with method=ar through lmms-eval's evaluator (in process: what the CLI calls, the model found by
  name through the entry point), then `python -m lmms_eval --model vpsd ... method=hippo` as the README gives it:
  equal scores and equal answers, which are `vpsd.LLM`'s own (tests/torchrun/test_api.py holds those to `ar`'s);
  the speed files lie beside lmms-eval's results, hippo's compared with ar's.
- With an engine batch of 2 and lmms-eval's `--gen_kwargs` turning sampling on, the answers are what `vpsd.LLM`
  samples for the same requests (the ids and seed the backend gives them); a document whose video is missing is
  answered empty and scored wrong while the others are answered; the loglikelihood form is refused, saying why.
- lmms-eval's own OpenAI backend (`--model openai`, the video as a file:// URL) against `vpsd serve` (hippo,
  batch 8): the task scores as `--model vpsd` does, with the same answers.
- With --slow: the answers are the torchrun job's, token for token, and a data-parallel run (two ranks, under
  torchrun and under `accelerate launch`) answers and times every document once, as one process does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmms_eval", reason="lmms-eval is not installed here (scripts/test_lmms_eval.sh installs it)")

import vpsd  # noqa: E402
from tests.torchrun_jobs import ROOT, results, run_launcher, torchrun_cmd  # noqa: E402
from vpsd.integrations.lmms_eval.requests import request_seed  # noqa: E402
from vpsd.bench.server_process import start_server  # noqa: E402

CONFIG = "configs/world_qwen2_5_vl.yaml"
MANIFEST = ROOT / "examples" / "world" / "manifest.jsonl"
TASK = "vpsd_world"
TASKS_DIR = ROOT / "examples" / "lmms_eval"
DOCS = [json.loads(line) for line in MANIFEST.read_text().splitlines()]
SAMPLED = 2.0  # a temperature at which the world pair's captions do differ from the greedy ones
METRICS = ("scene_correct,none", "caption_exact,none")


def cli(method: str, out: Path, hf_home: Path, *launcher: str) -> subprocess.CompletedProcess:
    """The README's command, from the repository root (the task's data path is relative to it)."""
    cmd = [*(launcher or [sys.executable]), "-m", "lmms_eval", "--model", "vpsd", "--model_args",
           f"config={CONFIG},method={method}", "--tasks", TASK, "--include_path", "examples/lmms_eval",
           "--output_path", str(out), "--log_samples"]
    # accelerate's multi-GPU launcher runs torchrun's agent itself, which would leave a /tmp/torchelastic_* behind:
    # its log directory (torchrun's PET_LOG_DIR, which accelerate's parse of torchrun's options reads) is the test's.
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PET_LOG_DIR": str(out.with_name(f"{out.name}-torchrun"))}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def cli_run(out: Path, method: str) -> dict:
    """What a CLI run wrote: its scores, answers by document and speed file."""
    samples = max(out.glob(f"*_samples_{TASK}.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    scores = max(out.glob("*_results.json"), key=lambda p: p.stat().st_mtime_ns)
    return {"scores": json.loads(scores.read_text())["results"][TASK],
            "answers": {s["doc_id"]: s["filtered_resps"] for s in map(json.loads, samples.read_text().splitlines())},
            "speed": json.loads((out / f"vpsd_speed_{TASK}_{method}.json").read_text())}


def evaluate(model_args: str, tasks: list[str], include: list[Path], **kwargs) -> dict:
    """lmms-eval's evaluator in this process, `--model vpsd` resolved by name, as the CLI does."""
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.tasks import TaskManager

    manager = TaskManager("WARNING", include_path=[str(p) for p in include], include_defaults=False)
    return simple_evaluate(model="vpsd", model_args=model_args, tasks=tasks, task_manager=manager, log_samples=True,
                           verbosity="WARNING", **kwargs)


@pytest.fixture(scope="module")
def in_root(tmp_path_factory):
    """lmms-eval's datasets cache in a temporary folder, the working directory the repository root."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        mp.setenv("LMMS_EVAL_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
        yield


@pytest.fixture(scope="module")
def runs(tmp_path_factory, in_root) -> tuple[dict, dict, Path]:
    """ar in process, then hippo through the CLI, into one output folder (hippo's speed file then meets ar's)."""
    out = tmp_path_factory.mktemp("lmms_out")
    res = evaluate(f"config={CONFIG},method=ar,stats_dir={out}", [TASK], [TASKS_DIR])
    ar = {"scores": res["results"][TASK],
          "answers": {s["doc_id"]: s["filtered_resps"][0] for s in res["samples"][TASK]},
          "speed": json.loads((out / f"vpsd_speed_{TASK}_ar.json").read_text())}
    proc = cli("hippo", out, tmp_path_factory.mktemp("hf_home"))
    assert proc.returncode == 0 and "Error during evaluation" not in proc.stdout, (proc.stdout + proc.stderr)[-4000:]
    return ar, cli_run(out, "hippo"), out


@pytest.fixture(scope="module")
def reference() -> dict[str, list]:
    """vpsd.LLM's answers to the task's requests, greedy (all), as the backend asks, and `ar`'s samples of the
    first three, each at the seed the backend gives its request (its id's): what a sampled hippo must answer."""
    requests = [vpsd.VideoRequest(str(MANIFEST.parent / d["video"]), d["prompt"], id=f"{TASK}:test:{i}")
                for i, d in enumerate(DOCS)]
    with vpsd.LLM(ROOT / CONFIG, method="hippo", batch=2) as llm:
        greedy = llm.generate(requests, vpsd.SamplingParams(max_new_tokens=64, stop=("\n\n",)))
    with vpsd.LLM(ROOT / CONFIG, method="ar") as llm:
        seeded = [dataclasses.replace(r, seed=request_seed(llm.config.decoding.seed, r.id)) for r in requests[:3]]
        sampled = llm.generate(seeded, vpsd.SamplingParams(max_new_tokens=64, temperature=SAMPLED, stop=("\n\n",)))
    return {"greedy": greedy, "sampled": sampled}


def test_hippo_through_the_cli_scores_and_answers_as_ar(runs, reference):
    ar, hippo, _ = runs
    assert hippo["answers"] == ar["answers"] == {i: o.text for i, o in enumerate(reference["greedy"])}
    assert {m: hippo["scores"][m] for m in METRICS} == {m: ar["scores"][m] for m in METRICS}
    assert ar["scores"]["scene_correct,none"] == 1.0  # the video reached the model: every scene is right
    rows = {r["id"]: r["token_ids"] for r in hippo["speed"]["rows"]}
    assert rows == {o.id: o.token_ids for o in reference["greedy"]}


def test_the_speed_files_lie_beside_the_results_hippo_against_ar(runs):
    (ar, hippo), out = (run["speed"] for run in runs[:2]), runs[2]
    assert list(out.glob("*_results.json")), "the speed file is not where lmms-eval wrote its results"
    assert ar["items_done"] == hippo["items_done"] == len(DOCS) and ar["items_failed"] == 0
    assert ar["mean_accepted_tokens"] == 1.0 < hippo["mean_accepted_tokens"]
    assert hippo["tokens"] == ar["tokens"] and hippo["tokens_per_s"] > 0 and hippo["decode_s"] > 0
    assert hippo["baseline"] == f"vpsd_speed_{TASK}_ar.json" and "speedup_vs_ar" not in ar
    assert hippo["items_compared"] == hippo["identical_outputs"] == len(DOCS)
    assert hippo["speedup_vs_ar"] > 0 and hippo["tokens_per_s_vs_ar"] > 0
    assert hippo["settings"]["method"] == "hippo" and hippo["ranks"] == 1


def test_sampled_batched_answers_are_ars_samples_and_a_missing_video_fails_alone(reference, in_root, tmp_path):
    from vpsd.integrations.lmms_eval.model import VpsdLmms

    # A second task over the first documents and one whose video is missing (the local task's YAML included).
    docs = [*DOCS[:2], {**DOCS[2], "id": "gone", "video": "videos/no-such-clip.mp4"}]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "missing.yaml").write_text(f"include: {TASKS_DIR / 'vpsd_world.yaml'}\ntask: vpsd_world_missing\n"
                                           f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'docs.jsonl'}\n")
    out = evaluate(f"config={CONFIG},method=hippo,stats_dir={tmp_path / 'speed'}", [TASK, "vpsd_world_missing"],
                   [TASKS_DIR, tmp_path], batch_size=2, limit=3, gen_kwargs=f"temperature={SAMPLED},do_sample=true")
    answers = {t: {s["doc_id"]: s["filtered_resps"][0] for s in out["samples"][t]}
               for t in (TASK, "vpsd_world_missing")}

    assert [answers[TASK][i] for i in range(3)] == [o.text for o in reference["sampled"]]
    assert [o.text for o in reference["sampled"]] != [o.text for o in reference["greedy"][:3]]
    missing = answers["vpsd_world_missing"]
    assert missing[2] == "" and missing[0] and missing[1]
    assert out["results"]["vpsd_world_missing"]["scene_correct,none"] < 1.0
    speed = json.loads((tmp_path / "speed" / "vpsd_speed_vpsd_world_missing_hippo.json").read_text())
    assert speed["items_done"] == 2 and speed["items_failed"] == 1 and speed["settings"]["batch"] == 2
    assert [r["error"] for r in speed["rows"] if r["error"]] == [
        f"VideoError: missing video {MANIFEST.parent / 'videos/no-such-clip.mp4'}: no such file or directory"]
    with pytest.raises(NotImplementedError, match="generate_until requests only"):
        VpsdLmms.loglikelihood(None, [])


@pytest.mark.slow
def test_the_answers_are_the_torchrun_jobs(runs, tmp_path):
    proc = run_launcher("world_qwen2_5_vl.yaml", MANIFEST, tmp_path / "job", "hippo", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = results(tmp_path / "job")
    assert runs[1]["answers"] == {i: job[doc["id"]]["text"] for i, doc in enumerate(DOCS)}
    assert {r["id"]: r["token_ids"] for r in runs[1]["speed"]["rows"]} == {
        f"{TASK}:test:{i}": job[doc["id"]]["token_ids"] for i, doc in enumerate(DOCS)}


# lmms-eval's two data-parallel launchers (accelerate's multi-GPU one runs gloo ranks where there is no GPU).
LAUNCHERS = {"torchrun": torchrun_cmd(2),
             "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_data_parallel_ranks_answer_as_one_process(runs, tmp_path, launcher):
    proc = cli("hippo", tmp_path / "dp", tmp_path / "hf", *LAUNCHERS[launcher])
    assert proc.returncode == 0 and "Error during evaluation" not in proc.stdout, (proc.stdout + proc.stderr)[-4000:]
    dp = cli_run(tmp_path / "dp", "hippo")
    assert dp["answers"] == runs[1]["answers"]
    assert dp["speed"]["ranks"] == 2 and sorted(r["id"] for r in dp["speed"]["rows"]) == sorted(
        r["id"] for r in runs[1]["speed"]["rows"])


@contextlib.contextmanager
def served(log: Path):
    """`vpsd serve` (hippo, batch 8) on a free loopback port, the world's videos allowed, until the block ends;
    yields its base URL."""
    proc, base = start_server(["--config", CONFIG, "--method", "hippo", "--batch", "8", "--allowed-media-dir",
                               str(MANIFEST.parent / "videos")], log, 120, cwd=ROOT)
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_lmms_evals_openai_backend_against_vpsd_serve_scores_as_model_vpsd(runs, tmp_path):
    """What a harness does with an OpenAI-compatible server: lmms-eval's `--model openai` (its chat form, the video
    as a file:// URL with 8 frames, as vLLM takes it) runs the task against `vpsd serve`."""
    ar, hippo, _ = runs
    with served(tmp_path / "serve.log") as base:
        cmd = [sys.executable, "-m", "lmms_eval", "--model", "openai", "--model_args",
               f"model_version=world_qwen2_5_vl,base_url={base}/v1,api_key=none,pass_video_url=True,"
               "max_frames_num=8,num_concurrent=8", "--tasks", TASK, "--include_path", "examples/lmms_eval",
               "--output_path", str(tmp_path / "out"), "--log_samples"]
        env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "OPENAI_API_KEY": "none"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Error during evaluation" not in proc.stdout, (proc.stdout + proc.stderr)[-4000:]
    out = tmp_path / "out"
    samples = next(out.rglob(f"*_samples_{TASK}.jsonl"))
    scores = json.loads(next(out.rglob("*_results.json")).read_text())["results"][TASK]
    answers = {s["doc_id"]: s["filtered_resps"] for s in map(json.loads, samples.read_text().splitlines())}
    assert answers == ar["answers"] == hippo["answers"]
    assert {m: scores[m] for m in METRICS} == {m: ar["scores"][m] for m in METRICS}
