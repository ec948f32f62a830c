"""Loaded at interpreter start when this folder is on PYTHONPATH: with
FASTATTN_TEST_FAKE_CORE=1, the process's fastattn runtime uses tests/fake_core.py
instead of cuDNN. How the CPU tests drive worker processes (fastattn warm)."""

import os
import sys

if os.environ.get("FASTATTN_TEST_FAKE_CORE") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import fake_core
    from fastattn import runtime

    fake_core.install(runtime)
