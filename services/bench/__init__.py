"""Benchmarks that measure a mechanism against a baseline taken in the same run (``flowgrpo bench``)."""
