"""GPU: plans built for this GPU by processes that do not use it (`fastattn warm --for`, whose
workers have fastattn's stand-in libcuda in the driver's place) load in a later process with
no build and give bitwise the outputs of plans built here, on fresh random inputs (the
configs' training ones are deterministic: their gradients too)."""

import json
import os
import subprocess
import sys

from fastattn import target

from helpers.cache_worker import CONFIGS, result, worker


def fastattn_cli(*argv, cache_dir, cwd):
    env = {**os.environ, "FASTATTN_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "-m", "fastattn", *argv], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def test_plans_built_for_this_gpu_elsewhere_load_without_a_build_and_match_bitwise(tmp_path):
    gpu_file = tmp_path / "gpu.json"
    exported = fastattn_cli("info", "--export-gpu", str(gpu_file), cache_dir=tmp_path / "unused", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    gpu = target.read(str(gpu_file))
    assert gpu.properties and gpu.sm_count > 0

    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps({"configs": CONFIGS}))
    built_for = tmp_path / "built-for"
    warm = fastattn_cli("warm", "--for", str(gpu_file), str(configs), "--no-torch-ops", "--json",
                        cache_dir=built_for, cwd=tmp_path)
    assert warm.returncode == 0, warm.stdout[-2000:] + warm.stderr[-2000:]
    assert json.loads(warm.stdout)["counts"]["built"] == len(CONFIGS)

    loaded = result(worker(built_for))
    assert loaded["builds"] == 0 and loaded["deserializations"] == len(CONFIGS), loaded
    here = result(worker(tmp_path / "built-here"))
    assert here["builds"] == len(CONFIGS)
    assert loaded["hashes"] == here["hashes"], {"engines built for this GPU elsewhere": loaded["engines"],
                                                "engines built here": here["engines"]}

    # A second `warm --for` finds them: nothing is built again.
    again = fastattn_cli("warm", "--for", str(gpu_file), str(configs), "--no-torch-ops", "--json",
                         cache_dir=built_for, cwd=tmp_path)
    assert again.returncode == 0 and json.loads(again.stdout)["counts"]["loaded"] == len(CONFIGS), again.stderr
