"""Benchmarks that last: each prints a table and writes JSON under bench/results/, and is run
again whenever what it measures may have moved.

    python -m bench.NAME [--help]      # from the repository root

bench.support holds what they share (the machine, JSON written whole, brokers, round ends).
One-off studies, whose figures are a dated report, live in studies/.
"""
