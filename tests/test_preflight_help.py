"""`regen preflight --help` says what the preflight checks (walk of issue 30): it claimed a check of the
hidden-state width and layout, which it never makes (that is `regen capture`'s), and did not name the tool-call
parser or the prompt set it judges the fleet against (docs/preflight-and-fleet.md)."""
from __future__ import annotations

import pytest

from pipeline.cli import main as regen_main


def test_preflight_help_names_what_it_checks_and_nothing_it_does_not(capsys):
    with pytest.raises(SystemExit):
        regen_main(["preflight", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "hidden" not in text
    for checked in ("model", "weight version", "context", "reasoning", "tool-call parser", "token ids",
                    "prompt set"):
        assert checked in text, checked
