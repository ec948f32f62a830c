"""What several test modules share, imported as `helpers.<name>` from any folder under
tests/ (pyproject.toml puts tests/ on sys.path: [tool.pytest.ini_options] pythonpath).

    gpu           device buffers (cuda-python) and the float64 attention reference (numpy)
    torch         what the fastattn.torch tests share (helpers.gpu stays free of PyTorch), a rotary reference
    redis         a private redis-server for the Redis tier's tests
    cli           one in-process run of the fastattn command
    cache_worker  the GPU cache tests' worker process, and how they start it

tests/fake_core.py (cuDNN's stand-in) and tests/fake_site/ stay at the top of tests/:
worker processes find them there through PYTHONPATH (conftest.py's fake_workers), and
the table of FASTATTN_* variables (docs/ENVIRONMENT.md) names them there.
"""
