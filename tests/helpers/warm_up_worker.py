"""One process of the warm-up's GPU tests (tests/runtime/test_warm_up_gpu.py): runs
fastattn.torch.attention() on SHAPES and prints one JSON line (a sha256 of each output,
fastattn.stats()). worker() starts one on a cache directory, with the warm-up as asked.

    python -m helpers.warm_up_worker MODE   (from tests/; MODE: calls, warm, capture)

  calls    the calls alone (to fill a cache, or with the warm-up off: plans loaded lazily)
  warm     make a CUDA context, wait for the warm-up to end, then the calls
  capture  make a CUDA context, run the most recently used shape once, then capture and
           replay CUDA graphs of it (global capture mode, PyTorch's default) again and
           again while the warm-up loads the others; each replay is compared with eager
  legacy   make a CUDA context and run PyTorch work once (cuBLAS ready), then import
           fastattn.torch and run that work on the legacy default stream (PyTorch's
           default), each round synchronized (torch.cuda.synchronize: a device-wide wait,
           which fails while any capture is open on the device), again and again while
           the warm-up loads; each result is compared with the first
  threads  wait for the warm-up to end (its loaders' handles passed on), then the calls
           from two new threads at once, each on a stream of its own
"""

import hashlib
import json
import os
import subprocess
import sys
import time

from helpers.paths import TESTS

SHAPES = [(1, 64 * i, 8, 64) for i in range(1, 25)]  # the last is the most recently used after a fill


def worker(cache_dir, mode: str, warm_up: str):
    env = {**os.environ, "FASTATTN_CACHE_DIR": str(cache_dir), "FASTATTN_WARM_UP": warm_up}
    return subprocess.run([sys.executable, "-m", "helpers.warm_up_worker", mode], capture_output=True, text=True,
                          env=env, cwd=TESTS, timeout=300)


def result(done) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _inputs(torch, shape):
    g = torch.Generator(device="cuda").manual_seed(shape[1])
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]


def _digest(torch, o) -> str:
    return hashlib.sha256(o.contiguous().view(torch.int16).cpu().numpy().tobytes()).hexdigest()


def _wait_done(fastattn, seconds=60.0) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        status = fastattn.stats()["warm_up"]
        if status["state"] in ("done", "failed", "stopped", "off"):
            return status
        time.sleep(0.005)
    raise AssertionError(f"the warm-up did not end in {seconds} s: {fastattn.stats()['warm_up']}")


def _while_loading(fastattn, step) -> tuple[int, int, int]:
    """step() again and again until a round starts after the warm-up has stopped loading:
    (rounds, rounds begun while it was still loading, of those while it loaded kernels)."""
    rounds = during = kernels = 0
    while True:
        state = fastattn.stats()["warm_up"]["state"]
        loading = state in ("libraries", "waiting", "loading", "kernels")
        step()
        rounds += 1
        during += loading
        kernels += state == "kernels"
        if not loading:
            return rounds, during, kernels


def main() -> None:
    mode = sys.argv[1]
    import torch

    out: dict = {"mode": mode}
    if mode == "legacy":  # the work ready before the warm-up starts, so that they overlap
        x = torch.randn(1024, 1024, device="cuda")
        first = (x @ x).sum(0)
        torch.cuda.synchronize()

    import fastattn
    from fastattn.torch import attention

    torch.zeros(1, device="cuda")  # the process's CUDA context, as a model load makes it
    if mode == "warm":
        out["warm_up"] = _wait_done(fastattn)
        out["before_calls"] = {k: fastattn.stats()[k] for k in ("builds", "deserializations")}
    if mode == "capture":
        shape = SHAPES[-1]
        q, k, v = _inputs(torch, shape)
        eager = attention(q, k, v, causal=True)
        torch.cuda.synchronize()

        def capture():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # global capture mode: any thread's unsafe call would invalidate it
                o = attention(q, k, v, causal=True)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(o, eager), "a replay differs from the eager call"

        captures, during, kernels = _while_loading(fastattn, capture)
        out.update(captures=captures, captures_while_loading=during, captures_while_loading_kernels=kernels,
                   warm_up=_wait_done(fastattn))
    elif mode == "legacy":
        def work():
            for _ in range(20):
                assert torch.equal((x @ x).sum(0), first), "work on the legacy stream went wrong"
            torch.cuda.synchronize()

        rounds, during, kernels = _while_loading(fastattn, work)
        out.update(rounds=rounds, rounds_while_loading=during, rounds_while_loading_kernels=kernels,
                   warm_up=_wait_done(fastattn))
    elif mode == "threads":
        import threading

        out["warm_up"] = _wait_done(fastattn)
        hashes: dict[int, list] = {}

        def calls(i: int) -> None:
            with torch.cuda.stream(torch.cuda.Stream()):
                got = []
                for shape in SHAPES:
                    q, k, v = _inputs(torch, shape)
                    got.append(_digest(torch, attention(q, k, v, causal=True)))
                hashes[i] = got

        threads = [threading.Thread(target=calls, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["thread_hashes"] = [hashes.get(i) for i in range(2)]
    else:
        out["hashes"] = []
        for shape in SHAPES:
            q, k, v = _inputs(torch, shape)
            out["hashes"].append(_digest(torch, attention(q, k, v, causal=True)))
    torch.cuda.synchronize()
    out["stats"] = {k: v for k, v in fastattn.stats().items() if isinstance(v, (int, float))}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
