"""Benchmarks and their reports: every ``ralmspec`` command that measures (``ralmspec bench
NAME`` with NAME one of spec, served, burst, soak, gen, batching, knn, costs, paper-table; and
``ralmspec gpu-check``). Each writes JSON and a Markdown table."""
