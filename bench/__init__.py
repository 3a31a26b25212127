"""Benchmarks: scripts that print a table comparing gpuwarden with a reference in one run."""
