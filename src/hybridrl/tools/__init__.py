"""Tools that are not part of a run: benchmarks, fault runs, the archive."""
