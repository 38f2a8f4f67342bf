"""The prefill thread's cores, lent to the decode thread at a job's tail (PrefillAhead.lend_cores_when_drained,
engine/prefill_ahead.py), are where its extra intra-op threads run: each OpenMP thread keeps the affinity its
creator had as it started, so one started while the decode thread was still pinned to its own core shares that
core with it (issue 61: the thread-invariance probe ran before the widening, and batched jobs ran 12-27% slower)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.torchrun_jobs import ROOT

# In a process of its own: the pinning, and the intra-op threads the lend starts, stay out of pytest's.
SCRIPT = r"""
import json, os, sys

import torch
from transformers import Qwen2_5_VLTextModel  # noqa: F401 - imported before the threads are counted

from vpsd.engine import prefill_ahead as module
from vpsd.engine.prefill_ahead import ListSource, PrefillAhead

c0, c1 = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)  # a pinned role's one intra-op thread (torchrun's OMP_NUM_THREADS=1)
os.sched_setaffinity(0, {c0})
real = module.bitwise_across_threads


def measured_then_lent(threads):
    real(threads)  # the probe runs where a job runs it (its forwards start the intra-op threads)...
    return True  # ...and the cores are lent whatever this machine's kernels answered


module.bitwise_across_threads = measured_then_lent
ahead = PrefillAhead(ListSource(["only"]), size=4, prepare=lambda items, hint: [item.upper() for item in items], cpus=[c1])
ahead.top_up(in_flight=0)
assert ahead.next_ready(block=True) == ("only", "ONLY")
assert ahead.drained
before = set(os.listdir("/proc/self/task"))
lent = ahead.lend_cores_when_drained()
x = torch.randn(512, 512)
for _ in range(3):  # the decode thread's forwards: parallel kernels on the lent threads
    x = torch.tanh(x @ x)
tasks = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in set(os.listdir("/proc/self/task")) - before}
json.dump(dict(lent=lent, main=sorted(os.sched_getaffinity(0)), started=tasks), sys.stdout)
ahead.close()
"""


def test_a_lent_intra_op_thread_can_run_on_the_lent_core():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two cores: one for the decode thread, one to lend")
    c0, c1 = cpus[:2]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(c0), str(c1)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout)
    assert seen["lent"] == 2 and seen["main"] == [c0, c1]
    assert seen["started"], "the lend started no intra-op thread"
    # Every thread the lend started (OpenMP's workers) may run on the lent core, not only on the decode thread's.
    assert all(c1 in allowed for allowed in seen["started"].values()), seen["started"]
