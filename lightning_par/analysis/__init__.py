"""Analysis tools for benchmarks and docs (e.g. replaying a pipeline schedule's table); training never imports them."""
