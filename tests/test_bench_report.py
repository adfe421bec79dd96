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


PROFILED = """# regen benchmarks

| benchmark | figure | value | goal | met |
|---|---|---:|---|:---:|
| overhead | ratio | 1.1x | >= 0.9x | yes |

## overhead

- note of the overhead run

### Profile (py-spy, an untimed run of the same workload)

| self % | function | | inclusive % | function |
|---:|---|---|---:|---|
| 16.7 | `Committer.flush` | | 79.2 | `_generate` |
"""


def test_merge_keeps_a_profile_table_in_its_section():
    """A benchmark's own tables (the py-spy profile) stay in its section, kept or redone; only benchmark rows
    go into the figures table, which ends where the first table ends."""
    kept = merged(NOW, PROFILED, {"production"}).splitlines()
    table = kept[:kept.index("## production")]
    assert "| overhead | ratio | 1.1x | >= 0.9x | yes |" in table
    assert not any("Committer.flush" in line or line.startswith("| self %") for line in table)
    section = kept[kept.index("## overhead (an earlier run)"):]
    assert section.index("| self % | function | | inclusive % | function |") + 2 == \
        section.index("| 16.7 | `Committer.flush` | | 79.2 | `_generate` |")
    redone = merged(PROFILED, NOW, {"overhead"}).splitlines()  # the new report has the profile
    assert redone.index("| production | lost | 0 | 0 | yes |") < redone.index("## overhead")


def test_a_section_kept_twice_is_marked_once():
    twice = merged(NOW, merged(NOW, EARLIER, {"production"}), {"production"})
    assert "## overhead (an earlier run)\n" in twice + "\n" and "(an earlier run) (an earlier run)" not in twice
