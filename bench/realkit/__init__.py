"""What the benchmarks run beside llmgw for real: the Rust routers (peers) and vLLM CPU engines.

A package, not scripts: ``make bench`` runs every ``bench/*.py`` as a benchmark.
"""
