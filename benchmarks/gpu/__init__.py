"""The design study's table on a GPU: pack the wheels, run, report (pack.sh, run.sh)."""
