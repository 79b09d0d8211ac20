"""Which code produced a result, found by the tool: tpweave's own git commit and whether its tree
differs from it, or (installed without a checkout) the package version and a hash of its sources.

A copy of the tree made elsewhere (the GPU machine's copy of this checkout carries git metadata that can lag
behind its files) proves its commit with a manifest written beside the checkout before the copy
(`write_manifest`, benchmarks/device_manifest.sh): the commit and the hash of that commit's sources. A run whose
sources hash to the manifest's ran that commit, clean; any other difference makes it dirty."""

from __future__ import annotations

import functools
import hashlib
import subprocess
from pathlib import Path
from typing import Any

import tpweave.log

PACKAGE_DIR = Path(tpweave.log.__file__).resolve().parent
MANIFEST_NAME = ".tpweave-manifest.json"  # at the checkout's root (git-ignored), carried with a copy of the tree


def source_hash(root: Path = PACKAGE_DIR) -> str:
    """sha256 over tpweave's Python sources (path and content of every .py file, in path order), 16 hex digits."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(PACKAGE_DIR), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_version() -> dict[str, Any]:
    """{"commit", "dirty", "source_hash", "version"}: commit is tpweave's own checkout's HEAD (None when
    tpweave is not in a git checkout); dirty says whether its sources differ from that commit."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        pkg_version = version("tpweave")
    except PackageNotFoundError:
        pkg_version = "unknown"
    commit = _git("rev-parse", "HEAD")
    dirty = None
    if commit is not None:
        top = _git("rev-parse", "--show-toplevel")
        status = _git("status", "--porcelain", "--", str(PACKAGE_DIR)) if top else None
        dirty = bool(status) if status is not None else None
    digest = source_hash()
    out = {"commit": commit, "dirty": dirty, "source_hash": digest, "version": pkg_version}
    manifest = _manifest()
    if dirty is not False and manifest is not None and manifest.get("source_hash") == digest:
        # git's view is stale or absent here, but these are exactly the sources of the manifest's commit
        out |= {"commit": manifest["commit"], "dirty": False, "proved_by": MANIFEST_NAME}
    return out


def _manifest() -> dict[str, Any] | None:
    import json
    import os

    path = Path(os.environ.get("TPWEAVE_MANIFEST") or PACKAGE_DIR.parents[1] / MANIFEST_NAME)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and {"commit", "source_hash"} <= set(data) else None


def write_manifest(path: Path | None = None) -> dict[str, str]:
    """Write the manifest (module doc) of this checkout's HEAD: its commit and the hash of its committed sources
    (`commit_source_hash`), whatever the working tree holds; the manifest."""
    import json

    commit = _git("rev-parse", "HEAD")
    if commit is None:
        raise RuntimeError("write_manifest needs tpweave's git checkout")
    manifest = {"commit": commit, "source_hash": commit_source_hash(commit)}
    target = path or PACKAGE_DIR.parents[1] / MANIFEST_NAME
    target.write_text(json.dumps(manifest) + "\n")
    return manifest


def describe(code: dict[str, Any]) -> str:
    """One line: 'commit abc1234', or with uncommitted changes or without a checkout the sources' hash
    (and the commit whose sources have that hash, when this checkout's history holds one)."""
    if code.get("commit") and code.get("dirty") is False:
        proved = f" (sources checked against {code['proved_by']})" if code.get("proved_by") else ""
        return f"commit {code['commit'][:10]}{proved}"
    where = f"commit {code['commit'][:10]} + uncommitted changes, " if code.get("commit") else ""
    text = f"{where}sources sha256:{code.get('source_hash')}"
    match = commit_of_sources(code.get("source_hash"))
    return text + (f" (= the sources of commit {match[:10]})" if match else "")


def _commit_hashes(commits: list[str]) -> dict[str, str]:
    """{commit: source_hash of its src/tpweave}, computed from git's objects (the checkout's files untouched)."""
    top = _git("rev-parse", "--show-toplevel")
    if not top or not commits:
        return {}
    prefix = Path(PACKAGE_DIR.relative_to(Path(top).resolve()).as_posix())
    trees: dict[str, list[tuple[Path, str]]] = {}
    for commit in commits:  # (path under the package, blob id) of every .py file
        listing = _git("ls-tree", "-r", "--full-tree", commit, "--", prefix.as_posix()) or ""
        entries = [line.split("\t", 1) for line in listing.splitlines()]
        trees[commit] = sorted(
            (Path(path).relative_to(prefix), meta.split()[2]) for meta, path in entries if path.endswith(".py")
        )
    blobs = sorted({blob for files in trees.values() for _, blob in files})
    contents = _cat_blobs(top, blobs)
    hashes = {}
    for commit in commits:
        h = hashlib.sha256()
        for rel, blob in trees[commit]:  # Path order: the order source_hash uses
            h.update(str(rel).encode())
            h.update(contents.get(blob, b""))
        hashes[commit] = h.hexdigest()[:16]
    return hashes


def commit_source_hash(commit: str) -> str | None:
    """source_hash of the sources committed at `commit`."""
    return _commit_hashes([commit]).get(commit)


@functools.lru_cache(maxsize=4)
def _history_hashes(commits: tuple[str, ...]) -> dict[str, str]:
    """_commit_hashes of a run of commits, kept: a commit's sources never change, and a report describing many
    results walks the same history for each (a `git ls-tree` call per commit)."""
    return _commit_hashes(list(commits))


def commit_of_sources(digest: str | None, *, max_commits: int | None = None) -> str | None:
    """The commit (of this checkout's history, or of its last `max_commits`) that brought in the newest src/tpweave
    with this source_hash: the oldest of the run of commits that have it, so commits that leave the sources alone do
    not change the answer. The whole history by default: an answer that changed as commits are added would make a
    summary generated from the same results differ from one day to the next."""
    if not digest:
        return None
    limit = [f"--max-count={max_commits}"] if max_commits is not None else []
    commits = (_git("rev-list", *limit, "HEAD") or "").split()
    hashes = _history_hashes(tuple(commits))
    found = None
    for commit in commits:  # newest first
        if hashes.get(commit) == digest:
            found = commit
        elif found is not None:
            break
    return found


def _cat_blobs(top: str, blobs: list[str]) -> dict[str, bytes]:
    """Contents of git blobs, read by one `git cat-file --batch`."""
    try:
        out = subprocess.run(["git", "-C", top, "cat-file", "--batch"], input="\n".join(blobs).encode() + b"\n",
                             capture_output=True, timeout=60).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    contents, pos = {}, 0
    for blob in blobs:
        header_end = out.index(b"\n", pos)
        size = int(out[pos:header_end].split()[2])
        contents[blob] = out[header_end + 1 : header_end + 1 + size]
        pos = header_end + 1 + size + 1
    return contents


ENV_PREFIXES = ("NCCL_", "TORCH_SYMM_MEM_", "TPWEAVE_", "CUDA_VISIBLE_DEVICES", "TORCH_NCCL_", "NVSHMEM_")
GPU_FIELDS = "index,name,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw,driver_version"


def versions() -> dict[str, Any]:
    """torch, Triton, NCCL and CUDA (runtime and driver) versions; None where absent."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            nccl = None
    gpus = gpu_state() or []
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "nccl": nccl,
        "cuda_runtime": torch.version.cuda,
        "cuda_driver": gpus[0]["driver_version"] if gpus else None,
    }


def gpu_state() -> list[dict[str, str]] | None:
    """Per GPU: name, SM and memory clocks (MHz, current and max), temperature (C), power (W), driver,
    from nvidia-smi; None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={GPU_FIELDS}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    keys = [k.replace(".", "_") for k in GPU_FIELDS.split(",")]
    return [dict(zip(keys, (v.strip() for v in line.split(",")))) for line in out.stdout.strip().splitlines()]


SAMPLED_FIELDS = "timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu"


class GpuSampler:
    """nvidia-smi sampling every GPU's clocks, power and temperature every `interval_ms` into a CSV file for as
    long as the `with` block runs (a run's clocks move with the power limit between its start and its end);
    `summary()` afterwards: the file, the number of samples, per GPU the SM clock and power (min / median /
    max). Without nvidia-smi nothing is sampled and the summary says so."""

    def __init__(self, path: Path, interval_ms: int = 500):
        self.path, self.interval_ms, self.proc, self.file, self.why = Path(path), interval_ms, None, None, ""

    def __enter__(self) -> GpuSampler:
        cmd = ["nvidia-smi", f"--query-gpu={SAMPLED_FIELDS}", "--format=csv,nounits", f"-lms={self.interval_ms}"]
        try:
            self.file = self.path.open("w")
            self.proc = subprocess.Popen(cmd, stdout=self.file, stderr=subprocess.DEVNULL)
        except OSError as e:  # no nvidia-smi (a CPU machine), or the file cannot be written
            self.why = f"not sampled: {e.strerror or e}"
            if self.file is not None:
                self.file.close()
                self.path.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.file.close()

    def summary(self) -> dict:
        """JSON-ready: {"file", "samples", "per_gpu": {index: {"sm_clock_mhz": [min, median, max],
        "power_w": [...]}}}, or {"file": None, "why": ...}."""
        if self.proc is None:
            return {"file": None, "why": self.why or "not sampled"}
        rows = [line.split(",") for line in self.path.read_text().splitlines()[1:] if line.count(",") >= 5]
        per_gpu: dict[str, dict[str, list[float]]] = {}
        for row in rows:
            try:
                sm, power = float(row[2]), float(row[4])
            except ValueError:  # "[N/A]"
                continue
            gpu = per_gpu.setdefault(row[1].strip(), {"sm": [], "power": []})
            gpu["sm"].append(sm)
            gpu["power"].append(power)

        def spread(values: list[float]) -> list[float]:
            values = sorted(values)
            return [values[0], values[len(values) // 2], values[-1]] if values else []

        return {"file": self.path.name, "samples": len(rows),
                "per_gpu": {i: {"sm_clock_mhz": spread(g["sm"]), "power_w": spread(g["power"])}
                            for i, g in per_gpu.items()}}  # fmt: skip


def environment() -> dict[str, str]:
    """The variables that change what communication does (NCCL_*, TORCH_SYMM_MEM_*, ...)."""
    import os

    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}


def content_hash(text: str) -> str:
    """sha256 of a text, 16 hex digits."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
