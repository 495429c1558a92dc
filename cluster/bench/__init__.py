"""Benchmarks and their reports: every ``ralmspec`` command that measures (``bench``,
``bench-batching``, ``bench-gen``, ``bench-knn``, ``served-bench``, ``burst-bench``, ``soak``,
``costs``, ``paper-table``, ``gpu-check``). Each writes JSON and a Markdown table."""
