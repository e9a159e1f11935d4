"""Throughput benchmarks of the Sebulba loop; each module prints JSON lines on stdout.

    python -m benchmarks.seed002
    python -m benchmarks.overlap

The figures, the machine they were taken on and how to read them: benchmarks/RESULTS.md.
"""
