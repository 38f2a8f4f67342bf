"""Launching real vpsd jobs through torchrun from tests, reading what they wrote, and the `ar` reference they are
held to, decoded in the test's own process (a job less to launch)."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from pytest import approx

from tests.conftest import tiny_pair
from vpsd.config import DecodingConfig, load_config
from vpsd.decoders.ar import decode_ar
from vpsd.launch.manifest import load_manifest
from vpsd.launch.torchrun import torchrun_command
from vpsd.reports.acceptance import load_rounds, summarize
from vpsd.video.item import load_item_frames

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def world_manifest(root: str, count: int = 2) -> Path:
    """A small manifest of procedural world videos (written once per session)."""
    from vpsd.world.dataset import write_manifest

    out = Path(root) / f"world{count}"
    if not (out / "manifest.jsonl").exists():
        write_manifest(out, seeds=list(range(count)), num_frames=8, size=(112, 112), max_new_tokens=24)
    return out / "manifest.jsonl"


def job_env() -> dict[str, str]:
    """The environment of a job a test launches: its ranks, like the suite (pyproject's filterwarnings), take a
    DeprecationWarning or FutureWarning for an error, so a deprecated call made only inside a role fails a test."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "error::DeprecationWarning,error::FutureWarning"}


def torchrun_cmd(nproc: int, *, extra: list[str] | None = None) -> list[str]:
    """torchrun on `nproc` ranks (standalone unless `extra` says otherwise), leaving nothing behind, as the benches
    launch it (vpsd/launch/torchrun.py): its log directory goes with the launch."""
    return torchrun_command(*(extra or ["--standalone"]), "--nproc-per-node", str(nproc))


def job_args(config: str, manifest: Path, out: Path, method: str, *more: str) -> list[str]:
    return ["-m", "vpsd.launch.entry", "--config", str(ROOT / "configs" / config), "--manifest", str(manifest),
            "--out", str(out), "--method", method, *more]


def run_job(config: str, manifest: Path, out: Path, method: str, *more: str, nproc: int = 3, timeout: float = 180,
            env_extra: dict[str, str] | None = None):
    env = {**job_env(), **(env_extra or {})}
    return subprocess.run(torchrun_cmd(nproc) + job_args(config, manifest, out, method, *more),
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def launcher_cmd(config: str, manifest: Path, out: Path, method: str, *more: str,
                 torchrun_opts: tuple[str, ...] = ()) -> list[str]:
    """The job through ./torchrun.sh, the users' launcher (3 standalone ranks unless told otherwise)."""
    return [str(ROOT / "torchrun.sh"), *torchrun_opts, "run", *job_args(config, manifest, out, method, *more)[2:]]


def run_launcher(config: str, manifest: Path, out: Path, method: str, *more: str, timeout: float = 180,
                 cwd: Path = ROOT, env_extra: dict[str, str] | None = None):
    """./torchrun.sh from `cwd`: relative paths are the caller's, as for a user in their own directory."""
    env = {**job_env(), **(env_extra or {})}
    return subprocess.run(launcher_cmd(config, manifest, out, method, *more), capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def results(out: Path) -> dict[str, dict]:
    path = Path(out) / "results.jsonl"
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ar_reference(family: str, manifest, **sampling) -> dict[str, list[int]]:
    """Plain autoregressive decoding of the target, in this process, on the same frames; `sampling`: decoding
    settings (temperature, top_p, seed, ...), an item's own "seed" before the given one."""
    cfg = load_config(ROOT / "configs" / f"tiny_{family}.yaml")
    target, _ = tiny_pair(family)
    items, _ = load_manifest(manifest)
    out = {}
    for it in items:
        frames, times = load_item_frames(it.video, cfg.video.num_frames, None, cfg.video.max_side)
        dec = DecodingConfig(gamma=cfg.decoding.gamma, max_new_tokens=it.max_new_tokens,
                             **{"temperature": 0.0, **sampling, **({"seed": it.seed} if it.seed is not None else {})})
        out[it.id] = decode_ar(target, frames, it.prompt, dec, times).token_ids
    return out


def assert_trace_rounds_add_up(out: Path, method: str, max_new: int) -> None:
    """A job's verify rounds, read back from its traces (reports/acceptance.py), add up to the tokens each item's
    result holds, and its stats are those rounds'. `method`: pearl (the parallel commit rule) or sd (serial); the
    job's config: configs/tiny_qwen2_5_vl.yaml."""
    eos = set(tiny_pair("qwen2_5_vl")[0].eos_token_ids)
    by_item = load_rounds(out)
    rows = results(out)
    assert set(by_item) == set(rows)
    for item_id, row in rows.items():
        rounds, tokens, stats = by_item[item_id], row["token_ids"], row["stats"]
        if method == "pearl":
            # TargetMachine: an all-accepted chunk commits its tokens (the bonus row is kept for the next
            # chunk, not sampled); a rejecting one commits the accepted prefix plus the target's token.
            # Every chunk begins exactly at the committed length, and the first at 0 (synchronous prefill).
            commits = [r.accepted + r.rejected for r in rounds]
            assert [r.start for r in rounds] == [sum(commits[:i]) for i in range(len(rounds))]
            before_last = rounds[-1].start
        else:
            # speculate(): the target's first token comes from its prefill; each round commits the accepted
            # drafts plus the target's own token (the correction or the bonus).
            commits = [1] + [r.accepted + 1 for r in rounds]
            before_last = sum(commits[:-1])
        committed = sum(commits)
        # The loop stops at the first round that reaches max_new_tokens or commits EOS; the output is the
        # committed sequence cut at max_new_tokens and after its first EOS.
        if len(tokens) == min(committed, max_new):
            assert before_last < len(tokens)
            assert not any(t in eos for t in tokens[:-1])
        else:
            assert tokens[-1] in eos and len(tokens) < min(committed, max_new)
            assert before_last < len(tokens)  # both stop at the round that commits EOS, even mid-round
        # MAT is what the rounds committed per verification, whatever the mode's rule for the bonus token.
        per_round = commits if method == "pearl" else commits[1:]
        assert stats["mean_accepted_tokens"] == approx(sum(per_round) / len(rounds))
        # The results' stats are these same rounds.
        s = summarize(rounds)
        assert (stats["rounds"], stats["rollbacks"]) == (s.rounds, s.rollbacks)
        assert stats["acceptance_rate"] == s.acceptance_rate
        assert stats["mean_accepted_tokens"] == s.mean_accepted_tokens
        assert stats["per_position_acceptance"] == s.per_position
        if method == "pearl":
            assert all((r.mode == "conservative") == (i > 0 and rounds[i - 1].rejected) for i, r in enumerate(rounds))


def role_pids(out: Path) -> dict[str, int]:
    """Each role's first process id, as its trace's role_started event says."""
    pids: dict[str, int] = {}
    for path in (Path(out) / "traces").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            ev = json.loads(line)
            if ev.get("event") == "role_started":
                pids.setdefault(ev["role"], ev["pid"])
    return pids


def wait_for_results(proc: subprocess.Popen, out: Path, count: int, timeout: float) -> None:
    """Until the job `proc` has written `count` results. A job that ends first fails the test at once with what it
    said; one that writes none in `timeout` is killed and the failure says where each rank was: the last events
    of its trace and its threads' stacks (SIGUSR1, vpsd/launch/entry.py) beside the job's stderr."""
    deadline = time.monotonic() + timeout
    while len(results(out)) < count:
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (exit {proc.returncode}) with {len(results(out))} of {count} "
                                 f"results:\n{_said(proc)}")
        if time.monotonic() > deadline:
            for pid in role_pids(out).values():
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            time.sleep(1.0)
            proc.kill()
            raise AssertionError(f"{len(results(out))} of {count} results after {timeout:.0f} s; the ranks' last "
                                 f"events:\n{_last_events(out)}\n{_said(proc)}")
        time.sleep(0.05)


def _said(proc: subprocess.Popen) -> str:
    try:
        stdout, stderr = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        return "(the job's output could not be read)"
    return f"stdout:\n{(stdout or '')[-2000:]}\nstderr:\n{(stderr or '')[-8000:]}"


def _last_events(out: Path, n: int = 6) -> str:
    tails = []
    for path in sorted((Path(out) / "traces").glob("*.jsonl")):
        tails.append(f"{path.name}:\n" + "\n".join(path.read_text().splitlines()[-n:]))
    return "\n".join(tails) or "(no traces)"
