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


def parser_actions():
    """(command path, action) for every option and argument of every command, from the
    parser itself: a test that sweeps flags sweeps one added later too."""
    import argparse

    from fastattn.cli._main import build_parser

    out = []

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, path + (name,))
            else:
                out.append((path, action))

    walk(build_parser(), ())
    return out

