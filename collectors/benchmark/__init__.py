"""The matmul benchmark: a collector that runs a short test in a child process (torch lives only there)."""
