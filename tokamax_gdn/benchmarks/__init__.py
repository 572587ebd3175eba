"""Benchmarks run by `tokamax-gdn bench`."""
