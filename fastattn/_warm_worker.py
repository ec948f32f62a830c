"""One worker process of fastattn.warm: reads one config (JSON) per line on stdin,
answers one JSON line per config.

Results go to the file descriptor that was stdout when the process started; stdout
itself is pointed at stderr, so that anything cuDNN or the driver prints cannot
corrupt the protocol.

An answer built here (not loaded) carries its cache key, so that the parent can check
that the entry is where the next run will look; and every answer carries the warnings
fastattn logged while working on it (a cache directory that cannot be written, ...),
which would otherwise end in this process's log file, unseen.
"""

import argparse
import json
import logging
import os
import signal
import sys


class _Collect(logging.Handler):
    """fastattn's warnings, kept for the next answer (and still written to stderr)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        try:
            self.messages.append(record.getMessage())
        except Exception:  # a malformed record must not cost the answer
            self.messages.append(str(record.msg))

    def take(self):
        out, self.messages = self.messages, []
        return out


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def main() -> int:
    # The parent decides when a run stops: on its interrupt it sends SIGTERM, which ends
    # this process between two Python steps (so that `finally` removes an entry being
    # written), and SIGKILL soon after where it is inside cuDNN. A Ctrl-C at a terminal,
    # which reaches the whole process group, is the parent's to handle.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", type=int, default=None)
    ap.add_argument("--verify", action="store_true")  # fastattn.warm's verify: probe(verify=True)
    ap.add_argument("--for", dest="gpu_file", default=None)  # fastattn.warm's target: build for that GPU
    args = ap.parse_args()
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    collect = _Collect()
    logger = logging.getLogger("fastattn")
    logger.addHandler(collect)
    logger.addHandler(logging.StreamHandler(sys.stderr))  # the worker's log, as without a handler

    import fastattn
    from fastattn import runtime

    target = None
    if args.gpu_file is not None:
        # Before anything can load the driver: this process builds for the file's GPU
        # (fastattn.target), with the stand-in libcuda in the driver's place.
        from fastattn import target as target_module

        try:
            target_module.enter_build_process()
            gpu = target_module.read(args.gpu_file)
            target = (gpu, runtime.open_plan_cache(gpu=gpu.key_fields()))
        except fastattn.FastAttnError as e:
            target = e  # each config's answer says so

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            if isinstance(target, fastattn.FastAttnError):
                raise target
            if target is not None:
                result, key = target_module.build(fastattn.AttentionConfig.coerce(line), *target)
                msg = {k: v for k, v in result.to_dict().items() if k != "config"}
                if key is not None:  # built and stored now (a refusal is not stored)
                    msg["key"] = key
            else:
                result = fastattn.probe(line, device=args.device, verify=args.verify)
                msg = {k: v for k, v in result.to_dict().items() if k != "config"}
                if result.source == "built":  # stored by this probe, if the cache took it
                    cache = runtime.plan_cache()
                    msg["key"] = cache.key(result.config, result.device) if cache.store.tiers else None
        except fastattn.FastAttnError as e:
            msg = {"error": type(e).__name__, "message": str(e)}
        except Exception as e:  # a bug: report it as data, keep the worker alive
            msg = {"error": type(e).__name__, "message": repr(e)}
        msg["warnings"] = collect.take()
        results.write(json.dumps(msg) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
