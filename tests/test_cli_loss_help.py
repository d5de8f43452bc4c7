"""``--loss``'s help lists every loss of the vocabulary (it once described only 'chunked')."""

from __future__ import annotations

import argparse

from memsave_nb import cli
from memsave_nb.vocabulary import LOSSES


def _loss_actions() -> list[tuple[str, argparse.Action]]:
    """(subcommand, its --loss action) for every subcommand that takes --loss."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [
        (name, action) for name, p in sub.choices.items() for action in p._actions if "--loss" in action.option_strings
    ]


def test_every_loss_is_in_the_help_with_its_meaning():
    found = _loss_actions()
    assert "report" in {name for name, _ in found}
    for name, action in found:
        assert tuple(action.choices) == tuple(LOSSES), name
        for loss, meaning in LOSSES.items():
            # each loss named with the first clause of its meaning, as the vocabulary words it
            assert f"{loss}: {meaning.split(': ')[0]}" in action.help, (name, loss)


def test_help_renders(capsys):
    try:
        cli.main(["report", "--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for loss in LOSSES:
        assert f"{loss}:" in out
