"""What the CLI tests share: one in-process run of the fastattn command, and a small cache
for the cache commands' tests."""

import fastattn
from fastattn import cli


def run(argv, capsys):
    """(exit code, stdout, stderr) of `fastattn <argv>` run in this process; never a traceback."""
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


# A small cache for the cache commands' tests: configs that differ in seqlen_q only.
BASE = dict(batch=1, heads_q=8, head_dim_qk=64, mask="causal")


def fill(n=3):
    """n plans and one refusal: n + 1 entries."""
    for s in range(n):
        fastattn.plan({**BASE, "seqlen_q": 128 * (s + 1)})
    fastattn.probe({**BASE, "seqlen_q": 128, "head_dim_qk": 1024})
