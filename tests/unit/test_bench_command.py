"""`vpsd bench`: one command in front of every benchmark (vpsd/bench/); each subcommand answers --help, and the
older form without a subcommand still reaches the method or the throughput bench."""

from __future__ import annotations

import pytest

from vpsd.bench import SUBCOMMANDS, main


def _help(argv: list[str], capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's --help
        code = e.code
    assert code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_answers_help(name, capsys):
    out = _help([name, "--help"], capsys)
    assert f"vpsd bench {name}" in out


@pytest.mark.parametrize(("argv", "reached"), [(["--manifest", "m.jsonl", "--help"], "methods"),
                                               (["--batch", "1,8", "--help"], "throughput"),
                                               (["--batch=8", "--help"], "throughput"),
                                               (["--report-only", "--help"], "throughput")])
def test_the_form_without_a_subcommand_reaches_its_bench(argv, reached, capsys):
    assert f"usage: vpsd bench {reached}" in _help(argv, capsys)


def test_the_command_lists_every_subcommand(capsys):
    out = _help(["--help"], capsys)
    assert all(f"vpsd bench {name} " in out for name in SUBCOMMANDS)
