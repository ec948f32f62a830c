"""The README's example runs as written (on a GPU)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_an_example():
    assert _python_blocks(), "README lost its example"


@pytest.mark.gpu
def test_readme_example_runs(capsys):
    exec(compile(_python_blocks()[0], str(README), "exec"), {})
    assert capsys.readouterr().out.startswith("True ")
