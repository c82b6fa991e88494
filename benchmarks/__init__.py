"""Benchmark programs: each prints a table, writes JSON, and reports a ratio to a same-run baseline."""
