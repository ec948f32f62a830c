"""GPU: the fastattn command end to end with real cuDNN plans, in fresh processes."""

import json
import os
import subprocess
import sys

from helpers.paths import TESTS

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
    # A signing secret: the bundle this machine exports is imported as signed and checked.
    env = {**os.environ, "FASTATTN_CACHE_DIR": str(cache_dir), "FASTATTN_CACHE_HMAC_KEY": "a test secret"}
    r = subprocess.run([sys.executable, "-m", "fastattn", *args, "--json"], capture_output=True, text=True, env=env,
                       cwd=TESTS, timeout=600)
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
    assert code == 0 and out["imported"] == 24 and out["policy"] == "signed and checked", err
    code, third, err = fastattn(other, "warm", str(f), "--workers", "4")
    assert code == 0 and third["counts"]["built"] == 0 and third["counts"]["loaded"] == 24
    code, verify, err = fastattn(other, "cache", "verify", "--load")
    assert code == 0 and verify["bad"] == 0


def test_matrix_on_the_gpu(tmp_path):
    code, out, err = fastattn(tmp_path, "matrix", "--head-dims", "64,128", "--masks", "none,causal", "--dtypes",
                              "bf16", "--gqa", "1,4", "--workers", "4")
    assert code == 0, err
    assert all(r["status"] in ("built", "loaded") for r in out["configs"])


def test_matrix_every_registry_feature_on_the_gpu(tmp_path):
    # The feature columns come from the field registry; each must reach cuDNN as a config
    # it answers (built or refused with a reason), never a failure. A feature no config
    # of the mode can have is a usage error (exit 2) before any GPU work: bias_grad
    # needs --training, paged is forward only. No mask: with one, window_br's (64, 64)
    # window is invalid (a causal mask fixes its right bound), so the column would be too.
    from fastattn.cli.matrix import MATRIX_FEATURES

    for training, impossible in ((False, "bias_grad"), (True, "paged")):
        features = [f for f in MATRIX_FEATURES if f != impossible]
        flags = ["--head-dims", "64,128", "--masks", "none", "--dtypes", "bf16", "--gqa", "1", "--seqlens", "256",
                 "--workers", "4", *(["--training"] if training else [])]
        code, out, err = fastattn(tmp_path / "cache", "matrix", *flags, "--features", ",".join(features))
        assert code == 0, err
        assert len(out["configs"]) == 2 * len(features)
        for r in out["configs"]:
            assert r["status"] in ("built", "loaded", "unsupported"), r
            assert r["status"] in ("built", "loaded") or r["reason"], r
        by = {(r["head_dim"], r["feature"]): r["status"] for r in out["configs"]}
        assert by[(128, "dense")] in ("built", "loaded")
        code, refused, err = fastattn(tmp_path / "cache", "matrix", *flags, "--features", impossible)
        assert code == 2 and f"--features {impossible}" in refused["message"], (refused, err)


def test_probe_with_registry_flags_on_the_gpu(tmp_path):
    base = ["probe", "--batch", "2", "--heads-q", "8", "--heads-kv", "2", "--seqlen-q", "256", "--head-dim-qk", "128"]
    for extra in (["--padding", "--ragged", "--max-tokens-q", "300"], ["--bias", "1hss", "--training", "--bias-grad"],
                  ["--dropout", "0.1", "--host-seed"], ["--sinks", "--mask", "causal_bottom_right"],
                  ["--padding", "--page-size", "64", "--num-pages", "9"], ["--scale", "0.05", "--window", "64", "0"]):
        code, out, err = fastattn(tmp_path / "cache", *base, *extra)
        assert code in (0, 1), (extra, code, err)
        assert "Traceback" not in err and out["config"]["batch"] == 2
        assert code == 0 or out["reason"]
