"""One "process" of the GPU cache tests: plans the configs given as JSON, runs each
forward (and backward when training) on seeded random inputs, and prints one JSON
line: the runtime's stats, a sha256 of every output, so that two processes can be
compared bit for bit, and each output's relative error against float64. worker() starts
one, result() reads its line.

    python -m helpers.cache_worker CONFIGS_JSON [--wait-until T] [--fake-cudnn-version V]   (from tests/)
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np

import fastattn
from fastattn import AttentionConfig, runtime

from helpers.gpu import DeviceBuffer, Tensor, random_inputs, reference, rel_error, synchronize
from helpers.paths import TESTS

CONFIGS = [
    AttentionConfig(batch=1, heads_q=8, seqlen_q=s, head_dim_qk=128, dtype="bf16", mask="causal",
                    training=True, deterministic=True).to_dict()
    for s in (256, 512)
] + [AttentionConfig(batch=2, heads_q=8, heads_kv=2, seqlen_q=384, head_dim_qk=64, dtype="fp16").to_dict()]


def worker(cache_dir, configs=CONFIGS, *extra):
    """A worker process on configs (dicts) with its own cache directory, started now."""
    env = {**os.environ, "FASTATTN_CACHE_DIR": str(cache_dir)}
    cmd = [sys.executable, "-m", "helpers.cache_worker", json.dumps(configs), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=TESTS)


def result(proc):
    """The worker's JSON line, once it has exited 0."""
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def run_one(cfg: AttentionConfig, seed: int) -> tuple[str, dict]:
    """The sha256 of the config's outputs on seeded inputs, and each output's relative error
    against the float64 reference."""
    p = fastattn.plan(cfg)
    q, k, v, d_o = random_inputs(cfg, np.random.default_rng(seed), backward=cfg.training)
    t = {n: Tensor(cfg, n) for n in ("q", "k", "v", "o")}
    for n, x in (("q", q), ("k", k), ("v", v)):
        t[n].write(x)
    ws = DeviceBuffer(p.workspace_size)
    digest = hashlib.sha256()
    if cfg.training:
        for n in ("stats", "d_o", "d_q", "d_k", "d_v"):
            t[n] = Tensor(cfg, n)
        t["d_o"].write(d_o)
        p.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, stats=t["stats"].ptr, workspace=ws.ptr)
        p.backward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, t["d_o"].ptr, t["stats"].ptr, t["d_q"].ptr,
                   t["d_k"].ptr, t["d_v"].ptr, workspace=ws.ptr)
        names = ("o", "stats", "d_q", "d_k", "d_v")
    else:
        p.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, workspace=ws.ptr)
        names = ("o",)
    synchronize()
    for n in names:
        digest.update(t[n].raw())
    o, stats, grads = reference(cfg, q, k, v, d_o)
    want = {"o": o, "stats": stats, **dict(zip(("d_q", "d_k", "d_v"), grads or ()))}
    return digest.hexdigest(), {n: rel_error(t[n].read(), want[n]) for n in names}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("configs")
    ap.add_argument("--wait-until", type=float, default=0.0)
    ap.add_argument("--fake-cudnn-version", type=int, default=0)
    args = ap.parse_args()
    configs = [AttentionConfig.from_dict(c) for c in json.loads(args.configs)]
    if args.fake_cudnn_version:
        # Describe this process as running another cuDNN: its keys then differ. The
        # runtime's one hook to the core answers versions() with the fake one.
        real = runtime._core

        class OtherCudnn:
            def __getattr__(self, name):
                return getattr(real(), name)

            def versions(self):
                return (args.fake_cudnn_version, *real().versions()[1:])

        desc = runtime.plan_cache().describe(configs[0], 0)
        runtime._core = OtherCudnn
        runtime.clear()
        assert runtime.plan_cache().describe(configs[0], 0)["cudnn"] == args.fake_cudnn_version != desc["cudnn"]
    while time.time() < args.wait_until:
        time.sleep(0.001)
    hashes, errors = zip(*(run_one(c, seed=1234 + i) for i, c in enumerate(configs)))
    # (the engines cuDNN chose: what tells a plan built elsewhere from one built here)
    engines = [[fastattn.plan(c).forward_engine, fastattn.plan(c).backward_engine] for c in configs]
    s = fastattn.stats()
    print(json.dumps({"hashes": list(hashes), "errors": list(errors), "engines": engines, "builds": s["builds"],
                      "disk_hits": s["disk_hits"], "deserializations": s["deserializations"], "misses": s["misses"],
                      "remote_hits": s["cache"].get("remote_hits", 0),
                      "cudnn_loaded": fastattn.versions()["cudnn_loaded"],
                      "capability": list(runtime.device_info(0)["compute_capability"])}))


if __name__ == "__main__":
    sys.exit(main())
