"""One worker process of fastattn.warm: reads one config (JSON) per line on stdin,
answers one JSON line per config.

Results go to the file descriptor that was stdout when the process started; stdout
itself is pointed at stderr, so that anything cuDNN or the driver prints cannot
corrupt the protocol.
"""

import argparse
import json
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", type=int, default=None)
    args = ap.parse_args()
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import fastattn

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            result = fastattn.probe(line, device=args.device)
            msg = {k: v for k, v in result.to_dict().items() if k != "config"}
        except fastattn.FastAttnError as e:
            msg = {"error": type(e).__name__, "message": str(e)}
        except Exception as e:  # a bug: report it as data, keep the worker alive
            msg = {"error": type(e).__name__, "message": repr(e)}
        results.write(json.dumps(msg) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
