"""Loaded at interpreter start when this folder is on PYTHONPATH: with
FASTATTN_TEST_FAKE_CORE=1, the process's fastattn runtime uses tests/fake_core.py
instead of cuDNN. How the CPU tests drive worker processes (fastattn warm)."""

import os
import sys

# (fastattn is imported only where one of its test variables is set; it reads them.)
_test_vars = [v for v in ("FASTATTN_TEST_FAKE_CORE", "FASTATTN_TEST_READONLY_FS") if v in os.environ]
if _test_vars:
    from fastattn import env as _env

if "FASTATTN_TEST_FAKE_CORE" in _test_vars and _env.get("FASTATTN_TEST_FAKE_CORE"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import fake_core
    from fastattn import runtime

    fake_core.install(runtime)

# FASTATTN_TEST_READONLY_FS=<dir>: writes under <dir> (opening for writing, making a
# folder, removing, renaming) fail as on a read-only mount (EROFS), which a test cannot
# otherwise make for a process running as root.
_readonly = _env.get("FASTATTN_TEST_READONLY_FS") if "FASTATTN_TEST_READONLY_FS" in _test_vars else None
if _readonly:
    import errno

    _real_open, _real_mkdir = os.open, os.mkdir
    _root = os.path.abspath(_readonly)

    def _inside(path) -> bool:
        try:
            p = os.path.abspath(os.fsdecode(path))
        except TypeError:  # a descriptor
            return False
        return p == _root or p.startswith(_root + os.sep)

    def _open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and _inside(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return _real_open(path, flags, mode, dir_fd=dir_fd)

    def _mkdir(path, mode=0o777, *, dir_fd=None):
        if _inside(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return _real_mkdir(path, mode, dir_fd=dir_fd)

    def _refused(real):
        """`real` (unlink, rmdir, rename...) refused for a path under the root: a
        read-only mount removes and renames nothing either."""
        def call(*paths, **kwargs):
            for path in paths:
                if _inside(path):
                    raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
            return real(*paths, **kwargs)

        return call

    os.open, os.mkdir = _open, _mkdir
    os.unlink, os.remove, os.rmdir = _refused(os.unlink), _refused(os.remove), _refused(os.rmdir)
    os.rename, os.replace = _refused(os.rename), _refused(os.replace)
