"""GPU: the persistent cache across real processes with real cuDNN plans."""

import json
import os
import subprocess
import sys
import time

import pytest

from fastattn import AttentionConfig

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = [
    AttentionConfig(batch=1, heads_q=8, seqlen_q=s, head_dim_qk=128, dtype="bf16", mask="causal",
                    training=True, deterministic=True).to_dict()
    for s in (256, 512)
] + [AttentionConfig(batch=2, heads_q=8, heads_kv=2, seqlen_q=384, head_dim_qk=64, dtype="fp16").to_dict()]


def worker(cache_dir, configs=CONFIGS, *extra, wait=True):
    env = {**os.environ, "FASTATTN_CACHE_DIR": str(cache_dir)}
    cmd = [sys.executable, os.path.join(HERE, "gpu_cache_worker.py"), json.dumps(configs), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=HERE)


def result(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_second_process_starts_warm_and_bitwise_identical(tmp_path):
    a = result(worker(tmp_path))
    assert a["builds"] == len(CONFIGS) and a["disk_hits"] == 0
    b = result(worker(tmp_path))
    assert b["builds"] == 0 and b["disk_hits"] == len(CONFIGS) and b["deserializations"] == len(CONFIGS)
    assert b["hashes"] == a["hashes"]


def test_entries_of_another_cudnn_are_not_used(tmp_path):
    result(worker(tmp_path))
    other = result(worker(tmp_path, CONFIGS, "--fake-cudnn-version", "99999"))
    assert other["builds"] == len(CONFIGS) and other["disk_hits"] == 0


def test_processes_started_together_build_a_missing_plan_once(tmp_path):
    start = time.time() + 8.0  # after every process has loaded CUDA and cuDNN
    one = [CONFIGS[0]]
    procs = [worker(tmp_path, one, "--wait-until", str(start)) for _ in range(8)]
    rows = [result(p) for p in procs]
    assert sorted(r["builds"] for r in rows) == [0] * 7 + [1], rows
    assert len({r["hashes"][0] for r in rows}) == 1
