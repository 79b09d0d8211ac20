"""Self-spawned multi-process runs: `launch(fn, *args, nprocs=N)`.

Each worker joins a fresh process group (gloo on CPU, NCCL when there is a GPU per rank) and calls
fn(ctx, *args). The caller gets every rank's return value, or the first failing rank's exception with
its traceback. A rank that dies, or a run that outlives `timeout_s`, ends all ranks with an error;
workers exit when the launching process dies.

Ranks start from multiprocessing's fork server with tpweave (torch, Dynamo, Inductor) imported once: a rank
starts in a fraction of a second instead of importing them anew (about 3.5 s of CPU each under "spawn"). The
server never runs a torch op, holds no GPU context, and a rank gets the launching process's sys.path, working
directory, `__main__` (as under spawn) and environment; where the environment has changed since the server
started (pytest's per-test PYTEST_CURRENT_TEST aside), the server is started again. Where the fork server is
someone else's or not available, ranks are spawned.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from tpweave.runtime.groups import SAFE_ENV, pick_backend


class WorkerError(RuntimeError):
    """A rank raised; the message carries that rank's traceback (and one line per other failed rank)."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed:\n{message}")
        self.rank, self.details = rank, message

    @property
    def summary(self) -> str:
        """The failing rank's own last line: `ValueError: ...`, or how its process ended."""
        own = self.details.split("\nrank ", 1)[0].strip().splitlines()
        return own[-1] if own else "no message"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _exit_with_parent() -> None:
    """Workers leave when the launching process dies (killed, out of memory): blocked in a collective or
    in results.put() with nobody reading, they would otherwise outlive it for good."""
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=lambda: (parent.join(), os._exit(1)), name="tpweave-parent-watch", daemon=True).start()


class _ForkServer:
    """multiprocessing's fork server with tpweave preloaded (module doc). Its environment is the one it started with:
    where the launcher's has changed since (a variable read when torch is imported could differ), it is started
    again. One per process, as multiprocessing keeps one fork server; one started by someone else (their preload)
    is left alone and ranks are spawned."""

    def __init__(self) -> None:
        self.env: tuple | None = None  # the environment ours started with; None: not started by us

    def context(self) -> mp.context.BaseContext | None:
        server = getattr(multiprocessing.forkserver, "_forkserver", None)
        if "forkserver" not in mp.get_all_start_methods() or not hasattr(server, "_stop"):
            return None
        env = _import_env()
        if self.env is None and server._forkserver_pid is not None:
            return None
        if self.env is not None and self.env != env:
            server._stop()
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["tpweave"])
        server.ensure_running()  # (again, if it died)
        self.env = env
        return context


def _import_env() -> tuple:
    """The environment as far as importing torch could read it: all of it but what pytest changes per test."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k not in _PER_TEST_ENV))


_PER_TEST_ENV = ("PYTEST_CURRENT_TEST",)
_FORK_SERVER = _ForkServer()


def _context() -> mp.context.BaseContext:
    """Where ranks start from (module doc): the fork server, else spawn."""
    return _FORK_SERVER.context() or mp.get_context("spawn")


def _worker(
    rank: int, nprocs: int, port: int, backend: str, collective_timeout_s: float, env, results, fn, args, kwargs
) -> None:
    _exit_with_parent()
    if env != os.environ:  # started by the fork server: the launching process's environment, as spawn gives
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(SAFE_ENV)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    from tpweave.runtime.groups import destroy_distributed, init_distributed

    try:
        ctx = init_distributed(backend=backend, timeout_s=collective_timeout_s)
        out = fn(ctx, *args, **kwargs)
        results.put((rank, "ok", _dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt/SystemExit, to the caller
        results.put((rank, "error", traceback.format_exc()))
        return
    try:
        # Leave together: rank 0 hosts the store, and a peer still tearing down after it exits logs
        # heartbeat errors. (A failed rank never gets here; the caller then kills the others.)
        torch.distributed.barrier()
        destroy_distributed()
    except Exception:
        pass


def _silent_exit(code: int | None) -> str:
    """Why a rank ended without reporting: its exit code, or the signal that killed it (SIGKILL, most often from
    the kernel's out-of-memory killer, is named as such)."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = f"process was killed by {name}"
        if -code == signal.SIGKILL:
            why += " (the kernel's out-of-memory killer sends it when the machine runs out of memory)"
        return f"{why} without reporting a result"
    return f"process exited with code {code} without reporting a result{_guard_hint()}"


def _guard_hint() -> str:
    """A hint when the launching script has no main guard (its ranks re-run it on import and die)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        source = open(path).read() if path else ""
    except OSError:
        return ""
    if source and "__main__" not in source:
        return f' ({path} has no `if __name__ == "__main__":` guard around tpweave.launch: each rank imports it)'
    return ""


def _drain(results, outputs: dict[int, Any]) -> dict[int, str]:
    failures: dict[int, str] = {}
    while not results.empty():
        rank, status, payload = results.get()
        if status == "error":
            failures[rank] = payload
        else:
            outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return failures


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int,
    backend: str | None = None,
    timeout_s: float = 600.0,
    collective_timeout_s: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Run fn(ctx, *args, **kwargs) on `nprocs` local ranks and return the per-rank results."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if getattr(sys.modules.get("__main__"), "__name__", "") == "__mp_main__":
        raise RuntimeError(
            "tpweave.launch was called while a spawned rank imported your script: put the call under "
            '`if __name__ == "__main__":` (each rank imports the script to find its function)'
        )
    backend = backend or pick_backend(nprocs)
    context = _context()
    results = context.SimpleQueue()
    port = free_port()
    procs = [
        context.Process(
            target=_worker,
            args=(rank, nprocs, port, backend, collective_timeout_s, dict(os.environ), results, fn, args, kwargs),
            daemon=True,
        )
        for rank in range(nprocs)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) < nprocs:
            failures = _drain(results, outputs)
            silent = [r for r, p in enumerate(procs) if r not in outputs and r not in failures and not p.is_alive()]
            if failures or silent:
                time.sleep(1.0)  # let the other ranks' reports arrive, to name the root cause
                failures |= _drain(results, outputs)
                silent = [r for r, p in enumerate(procs) if r not in outputs and r not in failures and not p.is_alive()]
                failures |= {r: _silent_exit(procs[r].exitcode) for r in silent}
                # A rank that died silently is the cause; the peers' errors are its consequence.
                root = silent[0] if silent else next(iter(failures))  # first reported
                others = "".join(
                    f"\nrank {r} also failed: {msg.strip().splitlines()[-1]}"
                    for r, msg in sorted(failures.items())
                    if r != root
                )
                raise WorkerError(root, failures[root] + others)
            if time.monotonic() > deadline:
                pending = sorted(set(range(nprocs)) - set(outputs))
                raise TimeoutError(
                    f"launch timed out after {timeout_s:.0f}s; ranks {pending} had not finished "
                    "(hung collective or dead peer?)"
                )
            time.sleep(0.02)
    finally:
        for p in procs:
            p.join(timeout=5 if len(outputs) == nprocs else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [outputs[r] for r in range(nprocs)]
