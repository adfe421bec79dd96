"""`make bench`: the pipeline benchmarks and their baselines, apart from production code. May import
anything; nothing in regen imports it (the user commands live in tools/)."""
