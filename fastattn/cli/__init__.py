"""The `fastattn` command (also `python -m fastattn`).

    fastattn info [--json]
    fastattn probe --batch 1 --heads-q 32 --seqlen-q 4096 --head-dim-qk 128 --mask causal [--json]
    fastattn probe --config cfg.json [--json]
    fastattn warm [FILE] [--workers N] [--report report.json] [--json]
    fastattn matrix [--head-dims 64,128,256] [--masks none,causal] [--gqa 1,4] [--features dense,bias,...]
                    [--png grid.png]
    fastattn cache ls | show KEY | verify [--load] | prune [--max-bytes N] [--max-age 30d] | clear
    fastattn cache export BUNDLE [--all] | import BUNDLE [--force] | push [--all] | pull [--all]

    fastattn --version

--json (anywhere on the line) makes stdout one JSON document on every path, usage
errors and bugs included. Exit codes: 0 success (probe: supported), 1 not supported by
cuDNN (warm: some configs), 2 bad input (flags, files, FASTATTN_* values, a refused
bundle), 3 no usable GPU stack (driver, CUDA or cuDNN missing, CUDA error; fastattn's own
extension not importable: a source tree shadowing the installed package), 4 some work failed (warm: a
config crashed or errored, or built answers not saved; verify: damaged entries; push, pull: Redis unreachable;
any command: stdout could not be written, a reader that went away excepted),
5 a bug in fastattn (an unexpected exception: one line, the traceback in a file),
130 interrupted (SIGINT), 143 terminated (SIGTERM).

One module per command group (info, probe, warm, matrix, cache); what they share (exit
codes, flag parsers, output) is in _common; the parser and `main` are in _main.
"""

from ._common import (EXIT_BAD_INPUT, EXIT_BUG, EXIT_CODES, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_NO_GPU, EXIT_OK,
                      EXIT_TERMINATED, EXIT_UNSUPPORTED)
from ._main import main

__all__ = ["main", "EXIT_OK", "EXIT_UNSUPPORTED", "EXIT_BAD_INPUT", "EXIT_NO_GPU", "EXIT_FAILED", "EXIT_BUG",
           "EXIT_INTERRUPTED", "EXIT_TERMINATED", "EXIT_CODES"]
