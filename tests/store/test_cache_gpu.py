"""GPU: the persistent cache across real processes with real cuDNN plans."""

import time

from helpers.cache_worker import CONFIGS, result, worker


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
