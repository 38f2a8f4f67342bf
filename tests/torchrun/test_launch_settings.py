"""Settings that only one method reads are checked when the job is launched, before any model loads."""

import re

import pytest

from vpsd.config import ConfigError

from tests.torchrun_jobs import ROOT
from vpsd.launch.entry import parse_args, resolve_config
from vpsd.pipeline.methods import get_method

CONFIG = str(ROOT / "configs" / "tiny_qwen2_5_vl.yaml")


def args(method: str, *more: str):
    return parse_args(["--config", CONFIG, "--manifest", "m.jsonl", "--out", "o", "--method", method, *more])


def test_a_bad_tabed_setting_stops_the_launch():
    with pytest.raises(ConfigError, match="tabed: tabed distance must be one of"):
        resolve_config(args("tabed", "--set", "tabed.distance=cosine"))
    with pytest.raises(ConfigError, match="unknown keys in tabed"):
        resolve_config(args("tabed", "--set", "tabed.windows=3"))
    assert resolve_config(args("tabed", "--set", "tabed.distance=tvd")).tabed.distance == "tvd"


def test_std_refuses_an_input_pruning_strategy_at_launch():
    with pytest.raises(ConfigError, match="method std: std picks its own KV entries"):
        resolve_config(args("std", "--pruning", "hippo"))
    assert resolve_config(args("std", "--ratio", "0.5")).pruning.ratio == 0.5


def test_tree_settings_at_launch():
    with pytest.raises(ConfigError, match="unknown tree 'pine'"):
        resolve_config(args("specvlm", "--set", "decoding.tree=pine"))
    with pytest.raises(ConfigError, match="skips rank 0"):
        resolve_config(args("sd-tree", "--set", "decoding.tree=[[1]]"))
    # specvlm drafts SpecVLM's (EAGLE's) tree unless told "chain"; a chain method ignores the setting.
    specvlm = get_method("specvlm")
    assert specvlm.draft_tree(resolve_config(args("specvlm")).decoding.tree).num_nodes == 25
    assert specvlm.draft_tree(resolve_config(args("specvlm", "--set", "decoding.tree=chain")).decoding.tree) is None
    shaped = resolve_config(args("sd-tree", "--set", "decoding.tree=[3,1]")).decoding.tree
    assert get_method("sd-tree").draft_tree(shaped).paths == ((0,), (1,), (2,), (0, 0), (1, 0), (2, 0))
    assert get_method("sd").draft_tree(shaped) is None


def test_drafting_knobs_are_typed_decoding_settings():
    """They were free-form extras: `lookahead` was never read, and `eager_when_idle: "false"` read as true."""
    cfg = resolve_config(args("pearl", "--set", "decoding.lookahead=12", "--set", "decoding.eager_when_idle=true"))
    assert cfg.decoding.lookahead_for(4) == 12 and cfg.decoding.eager_when_idle is True
    assert resolve_config(args("pearl")).decoding.lookahead_for(5) == 10  # two windows by default
    with pytest.raises(ConfigError, match="decoding.eager_when_idle must be bool, got 'false'"):
        resolve_config(args("pearl", "--set", 'decoding.eager_when_idle="false"'))
    with pytest.raises(ConfigError, match="unknown setting"):
        resolve_config(args("pearl", "--set", "eager_when_idle=true"))


def test_batch_size_at_launch():
    assert resolve_config(args("hippo", "--batch", "8")).batching.size == 8
    assert resolve_config(args("ar")).batching.size == 1
    for method in ("sd-tree", "specvlm", "std"):  # trees and sparse KV batch in the target's process
        assert resolve_config(args(method, "--batch", "4")).batching.size == 4
    with pytest.raises(ConfigError, match="method tabed: it drafts with TABED's views.*--batch 2 needs batching.pipelined=true"):
        resolve_config(args("tabed", "--batch", "2"))
    # TABED's views run in the role workers, so a pipelined batch takes it.
    assert resolve_config(args("tabed", "--batch", "2", "--set", "batching.pipelined=true")).batching.size == 2
    with pytest.raises(ConfigError, match="batching.size must be an int >= 1"):
        resolve_config(args("ar", "--batch", "0"))
    with pytest.raises(ConfigError, match="kv_budget_mib"):
        resolve_config(args("ar", "--set", "batching.kv_budget_mib=-1"))


def bad_settings_job(tmp_path):
    """A config with a missing checkpoint and a checkpoint of another family, plus mistyped --set values."""
    other = tmp_path / "qwen3-ckpt"
    other.mkdir(exist_ok=True)
    (other / "config.json").write_text('{"model_type": "qwen3_vl"}')
    config = tmp_path / "c.yaml"
    config.write_text(f"family: qwen2_5_vl\ntarget: {{path: {tmp_path / 'nope'}}}\ndraft: {{path: {other}}}\n")
    return ["--config", str(config), "--manifest", "m.jsonl", "--out", str(tmp_path / "o"), "--method", "pearl",
            "--set", "decoding.gamma=abc", "--set", "nosuch.key=1", "--set", "decodng.seed=1",
            "--set", "pruning.ratoi=0.5"]


EXPECTED = [
    "vpsd: --set nosuch.key: unknown setting",
    "vpsd: --set decodng.seed: unknown setting (did you mean 'decoding'?)",
    "vpsd: decoding: gamma must be an int >= 1 or 'auto', got 'abc'",
    "vpsd: unknown key pruning.ratoi (did you mean 'ratio'?)",
]


def test_every_bad_setting_is_one_line_said_once(tmp_path, capsys, monkeypatch):
    from vpsd.launch.entry import main

    monkeypatch.delenv("RANK", raising=False)
    assert main(bad_settings_job(tmp_path)) == 2
    assert capsys.readouterr().err.splitlines() == EXPECTED  # settings first: paths are checked once they parse
    assert main(bad_settings_job(tmp_path)[:8]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"vpsd: target.path: no such checkpoint directory: {tmp_path / 'nope'}",
                   f"vpsd: family 'qwen2_5_vl' does not match the draft checkpoint {tmp_path / 'qwen3-ckpt'} "
                   "(its config.json says model_type 'qwen3_vl'); set family: qwen3_vl"]
    monkeypatch.setenv("RANK", "1")  # the other ranks find the same problems and say nothing
    assert main(bad_settings_job(tmp_path)) == 2
    assert capsys.readouterr().err == ""
    assert not (tmp_path / "o").exists()  # nothing written, no model loaded


def test_gamma_auto_and_numbers_pass_the_settings_check():
    assert resolve_config(args("pearl", "--set", "decoding.gamma=auto")).decoding.gamma == "auto"
    assert resolve_config(args("pearl", "--set", "decoding.gamma=7")).decoding.gamma == 7


def test_the_launcher_says_a_refusal_in_vpsds_lines_alone(tmp_path):
    """./torchrun.sh: the ranks refuse, mark the launcher's file and exit 0, so torchrun prints no failure block
    of its own; the launcher exits 2. Started by torchrun directly, a refusing rank still exits 2."""
    from tests.torchrun_jobs import run_launcher

    proc = run_launcher("tiny_qwen2_5_vl.yaml", tmp_path / "m.jsonl", tmp_path / "o", "pearl",
                        "--set", "pruning.ratoi=0.5", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("vpsd:")]
    assert said == ["vpsd: unknown key pruning.ratoi (did you mean 'ratio'?)"]
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_refusing_rank_marks_the_launchers_file_only_when_every_rank_refuses(tmp_path, monkeypatch, capsys):
    from vpsd.launch.entry import REFUSAL_MARK, main, refuse

    mark = tmp_path / "refused"
    monkeypatch.setenv(REFUSAL_MARK, str(mark))
    monkeypatch.delenv("RANK", raising=False)
    assert main(bad_settings_job(tmp_path)) == 0 and mark.exists()
    mark.unlink()
    # A refusal only one rank reaches (the target's lock on --out) exits 2: torchrun then stops the others.
    assert refuse(["--out is busy"], reporter=True, every_rank=False) == 2 and not mark.exists()
    monkeypatch.delenv(REFUSAL_MARK)
    assert main(bad_settings_job(tmp_path)) == 2


def test_the_run_level_settings_are_typed_and_an_unknown_one_is_refused():
    """roles, cpu_affinity, timeouts and tabed were free-form `extra`: a typo there was read by nobody."""
    cfg = resolve_config(args("pearl", "--set", "timeout_s=30", "--set", "cpu_affinity={target: [0], draft: [0]}"))
    assert cfg.timeout_s == 30 and cfg.cpu_affinity == {"target": [0], "draft": [0]} and cfg.roles["pruner"] == 2
    with pytest.raises(ConfigError, match="timeout_s must be float, got 'soon'"):
        resolve_config(args("pearl", "--set", "timeout_s=soon"))
    with pytest.raises(ConfigError, match="roles must map target, draft and pruner to distinct ranks"):
        resolve_config(args("pearl", "--set", "roles={target: 0, draft: 0, pruner: 2}"))
    with pytest.raises(ConfigError, match="unknown setting"):
        resolve_config(args("pearl", "--set", "idle_timeout=5"))


def test_cpu_affinity_names_roles_and_cores_this_job_may_run_on():
    """A bad pin was a bare OSError in one rank's traceback at its first sched_setaffinity, under torchrun's
    failure block; a core that is not there, with others that are, ran the role on fewer cores silently."""
    import os

    from vpsd.launch.preflight import affinity_problems

    with pytest.raises(ConfigError, match=r"cpu_affinity: unknown role 'drafts' \(did you mean 'draft'\?\)"):
        resolve_config(args("pearl", "--set", "cpu_affinity={drafts: [1]}"))
    for bad in ("[]", "[-1]", "[1.5]", "'1'"):
        with pytest.raises(ConfigError, match="cpu_affinity.draft must be a non-empty list of core numbers"):
            resolve_config(args("pearl", "--set", f"cpu_affinity={{draft: {bad}}}"))
    from vpsd.config import load_config

    cfg = load_config(CONFIG, {"cpu_affinity": {"target": [0], "draft": [1, 3, 4, 5, 9]}})  # read, not launched
    assert affinity_problems(cfg, allowed={0, 1, 2, 3}) == [
        "cpu_affinity.draft: cores 4-5,9 not available to this job (it may run on 0-3; pin to those, or set "
        "cpu_affinity: null)"]
    assert affinity_problems(cfg, allowed={0, 1, 3, 4, 5, 9}) == []
    # At launch, against this process's own cores: one past the last is refused, the ones it has pass.
    mine = sorted(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match=f"cpu_affinity.pruner: core {mine[-1] + 1} not available"):
        resolve_config(args("pearl", "--set", f"cpu_affinity={{pruner: [{mine[-1] + 1}]}}"))
    assert resolve_config(args("pearl", "--set", f"cpu_affinity={{pruner: {mine}}}")).cpu_affinity == {"pruner": mine}


def test_a_config_file_with_a_section_nobody_reads_is_refused(tmp_path):
    from vpsd.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text((ROOT / "configs" / "tiny_qwen2_5_vl.yaml").read_text() + "\nlookahed: 3\n")
    with pytest.raises(ConfigError, match="unknown setting 'lookahed'"):
        load_config(path)


def test_a_manifest_or_out_the_job_cannot_use_is_refused_at_launch(tmp_path, capsys, monkeypatch):
    """They were tracebacks on the target rank after the models loaded (a FileExistsError for an --out that is a
    file), then torchrun's failure block; a bad argument was a usage block from every rank."""
    from vpsd.launch.entry import main

    monkeypatch.delenv("RANK", raising=False)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("")
    (tmp_path / "afile").write_text("")

    def said(manifest_arg, out_arg, *more):
        assert main(["--config", CONFIG, "--manifest", str(manifest_arg), "--out", str(out_arg), *more]) == 2
        return capsys.readouterr().err.splitlines()

    assert said(tmp_path / "nope.jsonl", tmp_path / "o") == [f"vpsd: --manifest {tmp_path / 'nope.jsonl'}: no such file"]
    assert said(tmp_path, tmp_path / "o") == [f"vpsd: --manifest {tmp_path}: not a file"]
    assert said(manifest, tmp_path / "afile" / "o") == [
        f"vpsd: --out {tmp_path / 'afile' / 'o'}: {tmp_path / 'afile'} is a file, not a directory"]
    assert said(manifest, tmp_path / "o", "--shard", "3/2") == [
        "vpsd: argument --shard: shard 3/2: need 0 <= I < N (--help lists the options)"]
    monkeypatch.setenv("RANK", "1")  # the other ranks find the same and say nothing
    assert said(tmp_path / "nope.jsonl", tmp_path / "o") == said(manifest, tmp_path / "o", "--shard", "3/2") == []
    assert not (tmp_path / "o").exists()


def test_a_config_or_checkpoint_that_cannot_load_is_one_line_at_launch(tmp_path, capsys, monkeypatch):
    """Invalid YAML or a config path that is a directory were tracebacks on every rank; a checkpoint missing a
    file its load reads first, or its weights, was a traceback on the loading rank after the others started."""
    import shutil

    from vpsd.launch.entry import main

    monkeypatch.delenv("RANK", raising=False)
    (tmp_path / "m.jsonl").write_text("")

    def said(config):
        assert main(["--config", str(config), "--manifest", str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "o"),
                     "--method", "ar"]) == 2
        return capsys.readouterr().err.splitlines()

    bad = tmp_path / "bad.yaml"
    bad.write_text("family: qwen2_5_vl\ntarget: {tiny: {seed: 0\n")
    (line,) = said(bad)  # the parser's own words after the place: libyaml's or PyYAML's ("did not find expected")
    assert line.startswith(f"vpsd: config {bad} is not valid YAML at line 3, column 1: ") and "expected ',' or '}'" in line
    assert said(tmp_path) == [f"vpsd: cannot read config {tmp_path}: Is a directory"]
    # The shipped world target, copied, then broken two ways.
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ROOT / "checkpoints" / "world_qwen2_5_vl" / "target", ckpt)
    config = tmp_path / "c.yaml"
    config.write_text(f"family: qwen2_5_vl\ntarget: {{path: {ckpt}}}\n")
    (ckpt / "model.safetensors").unlink()
    assert said(config) == [f"vpsd: target.path: {ckpt} holds no weights (model.safetensors or "
                            "model.safetensors.index.json; vpsd reads safetensors)"]
    (ckpt / "generation_config.json").unlink()
    assert said(config) == [f"vpsd: target.path: {ckpt / 'generation_config.json'}: missing (a published checkpoint "
                            "has it)"]
    assert not (tmp_path / "o").exists()


def test_settings_every_item_would_fail_on_are_refused_at_launch():
    """An unknown pruning strategy was a KeyError on the target rank and a ValueError on the pruner's; a zero
    frame count failed every item as it was read; --timeout 0 was read as no --timeout, and -5 crashed the
    process group's setup."""
    with pytest.raises(ConfigError, match=r"unknown pruning strategy 'hipo' \(did you mean 'hippo'\?\); known: attn,"):
        resolve_config(args("pearl", "--pruning", "hipo"))
    for setting, said in (("video.num_frames=0", "video.num_frames must be > 0 or null, got 0"),
                          ("video.fps=-1", "video.fps must be > 0 or null, got -1"),
                          ("decoding.max_new_tokens=0", "max_new_tokens must be an int >= 1, got 0")):
        with pytest.raises(ConfigError, match=re.escape(said)):
            resolve_config(args("ar", "--set", setting))
    assert resolve_config(args("ar", "--set", "video.num_frames=null", "--set", "video.fps=2")).video.fps == 2
    for timeout in ("0", "-5", "soon"):
        with pytest.raises(SystemExit):
            args("ar", "--timeout", timeout)
    assert args("ar", "--timeout", "2.5").timeout == 2.5


def test_run_help_is_said_once_at_once_with_the_methods_strategies_and_tools():
    """`./torchrun.sh run --help` is answered by one process before any rank starts: one usage block, not one per
    rank after their imports, naming every method, every pruning strategy and the vpsd tools."""
    import subprocess
    import time

    from vpsd.pipeline.methods import METHODS
    from vpsd.pipeline.pruning.strategies import STRATEGIES

    t0 = time.monotonic()
    proc = subprocess.run([str(ROOT / "torchrun.sh"), "run", "--help"], capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("usage:") == 1 and "torch.distributed" not in proc.stdout + proc.stderr
    assert all(re.search(rf"^  {re.escape(name)} ", proc.stdout, re.M) for name in METHODS)
    assert all(name in proc.stdout for name in STRATEGIES)
    assert "vpsd summary" in proc.stdout and "vpsd world" in proc.stdout
    assert elapsed < 30  # no rank, no model: the imports of one light module


@pytest.mark.parametrize("device, gpus, problem", [
    ("cpu", 0, None),
    ("cuda", 1, None),
    ("cuda:1", 2, None),
    ("cuda", 0, "target.device: 'cuda' but this machine has no CUDA device"),
    ("cuda:3", 1, "target.device: 'cuda:3' but this node has 1 GPU (cuda:0)"),
    ("cuda:2", 2, "target.device: 'cuda:2' but this node has 2 GPUs (cuda:0-1)"),
    ("mps", 0, "target.device: 'mps' is not a device vpsd runs on"),
    ("cuda:x", 1, "target.device: 'cuda:x' is not a device vpsd runs on"),
])
def test_a_model_device_the_node_lacks_is_refused_at_launch(device, gpus, problem):
    import dataclasses

    from vpsd.config import load_config
    from vpsd.launch.preflight import device_problems

    cfg = load_config(ROOT / "configs" / "tiny_qwen2_5_vl.yaml")
    cfg = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, device=device))
    problems = device_problems(cfg, gpus)
    assert (problems[0].startswith(problem) if problem else problems == []), problems


def test_a_cuda_model_on_a_machine_without_one_stops_the_launch():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    args = parse_args(["--config", str(ROOT / "configs/tiny_qwen2_5_vl.yaml"), "--manifest", "m", "--out", "o",
                       "--set", "draft.device=cuda:1"])
    with pytest.raises(ConfigError, match=r"draft.device: 'cuda:1' but this machine has no CUDA device"):
        resolve_config(args)
