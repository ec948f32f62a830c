"""What the CLI tests share: one in-process run of the fastattn command."""

from fastattn import cli


def run(argv, capsys):
    """(exit code, stdout, stderr) of `fastattn <argv>` run in this process; never a traceback."""
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err
