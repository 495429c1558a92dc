"""Command line, local cluster bootstrap, index building, evaluation and benchmarks."""
