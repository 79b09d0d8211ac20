"""How the command line fails: one line naming the flag, file or value, and an exit status that tells the truth."""

from __future__ import annotations

# Exit statuses: 0 everything ran and passed its checks; 1 a run failed (a rank raised, every request
# failed, a check failed); 2 bad input (flag, file, value), refused before any rank started.
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CLIError(Exception):
    """A user error found before any rank starts: printed as one `tpweave: error: ...` line, exit status 2."""
