"""The session's dispatch line says how many endpoints take work and which the preflight holds out (walk of issue 31:
"dispatch: 60 prompts to 3 endpoints" while one of them was held out by the preflight)."""
from __future__ import annotations

from pipeline.dispatch.session import dispatch_line


def test_the_dispatch_line_counts_the_endpoints_that_take_work_and_names_those_held_out():
    labels = ["emu1", "emu2", "emu3"]
    assert dispatch_line(60, "prompts", labels, set(), {}) == "dispatch: 60 prompts to 3 endpoints"
    assert dispatch_line(60, "prompts", labels, {"emu3"}, {}) == (
        "dispatch: 60 prompts to 2 of 3 endpoints; 1 held out by the preflight, joining once it passes: "
        "emu3 (unreachable)")
    assert dispatch_line(18, "samples (3 per prompt)", labels, {"emu1"}, {"emu3": "context too short"}) == (
        "dispatch: 18 samples (3 per prompt) to 1 of 3 endpoints; 2 held out by the preflight, joining once they "
        "pass: emu1 (unreachable), emu3 (refused)")
    # an endpoint the preflight named that is no longer in the fleet (removed from the endpoints file) is not counted
    assert dispatch_line(60, "prompts", labels[:2], {"emu3"}, {}) == "dispatch: 60 prompts to 2 endpoints"
