"""Benchmarks: each module registers side-by-side measurements with :mod:`.registry`."""
