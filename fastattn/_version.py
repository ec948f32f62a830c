"""fastattn's version, written once. pyproject.toml reads it (`[tool.setuptools.dynamic]`);
fastattn.__version__, the cache's descriptions (plan_cache), versions() (runtime) and the
op library's build tag (_opslib) import it from here. A module that imports nothing, so
that none of them imports the package's __init__, which imports them.
"""

__version__ = "0.1.0"
