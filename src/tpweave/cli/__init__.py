"""The `tpweave` command line: demo, calibrate, generate, bench layer | latency | serve, report."""

from tpweave.cli.main import main

__all__ = ["main"]
