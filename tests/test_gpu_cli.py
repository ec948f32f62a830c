"""GPU: the fastattn command end to end with real cuDNN plans, in fresh processes."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(os.path.abspath(__file__))
WARM_FILE = """
[[configs]]
batch = 1
heads_q = 16
heads_kv = [4, 16]
head_dim_qk = [64, 128]
seqlen_q = { from = 256, to = 1024, times = 2 }
mask = "causal"
training = [false, true]
"""


def fastattn(cache_dir, *args):
    env = {**os.environ, "FASTATTN_CACHE_DIR": str(cache_dir)}
    r = subprocess.run([sys.executable, "-m", "fastattn", *args, "--json"], capture_output=True, text=True, env=env,
                       cwd=HERE, timeout=600)
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else {}, r.stderr


def test_warm_info_rewarm_export_import(tmp_path):
    f = tmp_path / "w.toml"
    f.write_text(WARM_FILE)
    cache, other = tmp_path / "cache", tmp_path / "other"
    code, first, err = fastattn(cache, "warm", str(f), "--workers", "4")
    assert code == 0, err
    assert first["counts"] == {"built": 24, "loaded": 0, "unsupported": 0, "failed": 0}
    code, info, err = fastattn(cache, "info")
    assert code == 0 and info["cache"]["entries"][0]["entries"] == 24 and info["device"]["sm_count"] > 0
    code, second, err = fastattn(cache, "warm", str(f), "--workers", "4")
    assert code == 0 and second["counts"]["loaded"] == 24 and second["counts"]["built"] == 0
    assert second["seconds"] < first["seconds"]
    bundle = tmp_path / "b.tar.gz"
    code, out, err = fastattn(cache, "cache", "export", str(bundle))
    assert code == 0 and out["exported"] == 24, err
    code, out, err = fastattn(other, "cache", "import", str(bundle))
    assert code == 0 and out["imported"] == 24, err
    code, third, err = fastattn(other, "warm", str(f), "--workers", "4")
    assert code == 0 and third["counts"]["built"] == 0 and third["counts"]["loaded"] == 24
    code, verify, err = fastattn(other, "cache", "verify", "--load")
    assert code == 0 and verify["bad"] == 0


def test_matrix_on_the_gpu(tmp_path):
    code, out, err = fastattn(tmp_path, "matrix", "--head-dims", "64,128", "--masks", "none,causal", "--dtypes",
                              "bf16", "--gqa", "1,4", "--workers", "4")
    assert code == 0, err
    assert all(r["status"] in ("built", "loaded") for r in out["configs"])
