"""Throughput benchmarks of the Sebulba loop; each module prints JSON lines on stdout.

    python -m benchmarks.acting_spg
    python -m benchmarks.overlap

The figures, the machine they were taken on and how to read them: benchmarks/RESULTS.md.
"""
