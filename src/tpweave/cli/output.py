"""Where results go: the folder the user names (--output-dir), or a new timestamped folder under
./tpweave-results; files of an earlier run are never overwritten without --overwrite."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from tpweave.cli.errors import CLIError

DEFAULT_ROOT = Path("tpweave-results")


def results_dir(output_dir: str | None, name: str, *, files: list[str], overwrite: bool) -> Path:
    """The folder a run writes `files` into, created. Refuses (CLIError) one that already holds any of them
    unless `overwrite`; without --output-dir: tpweave-results/<name>-<UTC timestamp>."""
    if output_dir is None:
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
        out = DEFAULT_ROOT / f"{name}-{stamp}"
        n = 1
        while out.exists():
            n += 1
            out = DEFAULT_ROOT / f"{name}-{stamp}-{n}"
    else:
        out = Path(output_dir)
        if out.exists() and not out.is_dir():
            raise CLIError(f"--output-dir {output_dir}: exists and is not a folder")
        taken = [f for f in files if (out / f).exists()]
        if taken and not overwrite:
            raise CLIError(
                f"--output-dir {output_dir} already holds {', '.join(taken)} from an earlier run: choose another "
                "folder or --name, or pass --overwrite"
            )
    flag = f"--output-dir {output_dir}" if output_dir is not None else f"results folder {out}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".tpweave-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as e:  # a file where a folder should be, no permission, a read-only file system
        raise CLIError(f"{flag}: cannot write there ({e.strerror or e})") from None
    return out
