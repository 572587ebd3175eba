"""Benchmarks run by `tokamax-gdn bench`, and the tuning run of `tokamax-gdn autotune`."""
