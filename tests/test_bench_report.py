"""`make bench ARGS="--only X --merge"`: the report keeps every other benchmark's figures from the earlier one."""
from pipeline.bench.suite import merged

EARLIER = """# regen benchmarks

| benchmark | figure | value | goal | met |
|---|---|---:|---|:---:|
| overhead | ratio | 1.1x | >= 0.9x | yes |
| production | lost | 3 | 0 | **no** |

## overhead

- note of the overhead run

## production

- the old production note
"""

NOW = """# regen benchmarks

| benchmark | figure | value | goal | met |
|---|---|---:|---|:---:|
| production | lost | 0 | 0 | yes |

## production

- the new production note
"""


def test_merge_replaces_the_rerun_benchmark_and_keeps_the_others():
    report = merged(NOW, EARLIER, {"production"})
    assert "| production | lost | 0 | 0 | yes |" in report
    assert "| production | lost | 3 |" not in report and "the old production note" not in report
    assert "| overhead | ratio | 1.1x | >= 0.9x | yes |" in report
    assert "## overhead (an earlier run)" in report and "note of the overhead run" in report
    assert report.index("| overhead |") < report.index("## production")  # the kept row is in the table
