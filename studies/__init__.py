"""One-off studies: each answers one question of an issue, and its figures are a dated report
in studies/results/NAME.md (the commit, the machine, the command), not a table that is kept
up to date.

    python -m studies.NAME [--help]    # from the repository root

They write their JSON under bench/results/ and share bench.support with the benchmarks.
"""
