"""Several TP ranks on ONE GPU, as threads of one process, for the symmetric-memory protocols of
tpweave's own kernels (ce_overlap, triton_ar_norm*): torch's allocator refuses two ranks on one device,
and a protocol bug (a slot overwritten while a peer reads it, a signal sent twice, a wrong offset)
would otherwise only show on a multi-GPU machine, as a hang or wrong numbers.

Each thread is a rank with its own streams. `symm_buffers.reserve` / `handle` are replaced by buffers
and signal pads in ordinary device memory that every rank addresses (rendezvous = a thread barrier,
like torch's, at the same point of each rank's program), with torch's layout (pad[channel * world +
src]) and semantics (put_signal: compare-and-swap 0 -> 1 with release, spinning while the slot is
still set; wait_signal: 1 -> 0 with acquire; barrier: signal every peer, then wait for every peer).
What it checks: slot sizes and offsets, the order of pushes, signals and reads, buffer reuse over
back-to-back calls and CUDA-graph replays, any M and world size. What it cannot: the weaker ordering
of NVLink between GPUs, and any timing.

`run(world_size, fn, *args)` runs fn(ctx, *args) on every emulated rank in a fresh process (so the
CUDA settings below apply and a deadlock ends in a timeout, not a hung test session).
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import threading
import traceback
from dataclasses import dataclass

import torch


@dataclass
class EmulatedContext:
    rank: int
    world_size: int
    group_name: str = "emulated"
    device: torch.device = torch.device("cuda", 0)


_RANK = threading.local()  # .rank of the calling thread


def _signal_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def cas_spin(slot_ptr, EXPECTED: tl.constexpr, DESIRED: tl.constexpr, ACQUIRE: tl.constexpr):
        # a scalar atomic: one thread of the program performs it
        if ACQUIRE:
            old = tl.atomic_cas(slot_ptr, EXPECTED, DESIRED, sem="acquire", scope="sys")
            while old != EXPECTED:
                old = tl.atomic_cas(slot_ptr, EXPECTED, DESIRED, sem="acquire", scope="sys")
        else:
            old = tl.atomic_cas(slot_ptr, EXPECTED, DESIRED, sem="release", scope="sys")
            while old != EXPECTED:
                old = tl.atomic_cas(slot_ptr, EXPECTED, DESIRED, sem="release", scope="sys")

    return cas_spin


class EmulatedHandle:
    """What tpweave's kernels use of torch's symmetric-memory handle, over one device."""

    def __init__(self, rank: int, world_size: int, bufs: list[torch.Tensor], pads: list[torch.Tensor], cas_spin):
        self.rank, self.world_size = rank, world_size
        self._bufs, self._pads, self._cas_spin = bufs, pads, cas_spin
        self._ptr_table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=bufs[0].device)
        self._pad_table = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64, device=bufs[0].device)
        self.buffer_ptrs = [b.data_ptr() for b in bufs]
        self.signal_pad_ptrs = [p.data_ptr() for p in pads]
        self.buffer_ptrs_dev = self._ptr_table.data_ptr()
        self.signal_pad_ptrs_dev = self._pad_table.data_ptr()

    def get_buffer(self, rank: int, sizes, dtype: torch.dtype, storage_offset: int = 0) -> torch.Tensor:
        raw = self._bufs[rank].view(-1).view(torch.uint8)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        start, nbytes = storage_offset * itemsize, math.prod(sizes) * itemsize
        if start + nbytes > raw.numel():  # torch's get_buffer refuses this too
            raise RuntimeError(f"get_buffer: {nbytes} bytes at offset {start} exceed the {raw.numel()}-byte buffer")
        return raw[start : start + nbytes].view(dtype).view(*sizes)

    def _spin(self, pad: torch.Tensor, slot: int, expected: int, desired: int, acquire: bool) -> None:
        self._cas_spin[(1,)](pad[slot : slot + 1], EXPECTED=expected, DESIRED=desired, ACQUIRE=acquire, num_warps=1)

    def put_signal(self, dst_rank: int, channel: int = 0) -> None:
        self._spin(self._pads[dst_rank], channel * self.world_size + self.rank, 0, 1, acquire=False)

    def wait_signal(self, src_rank: int, channel: int = 0) -> None:
        self._spin(self._pads[self.rank], channel * self.world_size + src_rank, 1, 0, acquire=True)

    def barrier(self, channel: int = 0) -> None:
        peers = [r for r in range(self.world_size) if r != self.rank]
        for peer in peers:
            self.put_signal(peer, channel)
        for peer in peers:
            self.wait_signal(peer, channel)


class EmulatedWorld:
    """The buffers, handles and side streams of every emulated rank; installs itself in place of
    symm_buffers.reserve / handle and ce_overlap's side streams (in the child process only)."""

    def __init__(self, world_size: int):
        from torch._C._distributed_c10d import _SymmetricMemory

        self.world_size = world_size
        self.rendezvous = threading.Barrier(world_size)
        self.capture_barrier = threading.Barrier(world_size)
        self.pad_numel = getattr(_SymmetricMemory, "signal_pad_size", 2048) // 4
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.exchange: dict[tuple, list] = {}
        self.handles: dict[int, EmulatedHandle] = {}
        self.retired: list[torch.Tensor] = []
        self.streams: dict[tuple[int, str], torch.cuda.Stream] = {}
        self.cas_spin = _signal_kernel()

    def reserve(self, group_name, numel, dtype, device, *, tag="staging"):
        rank, key = _RANK.rank, (group_name, dtype, torch.device(device), tag)
        buf = self.buffers.get((key, rank))
        if buf is None or buf.numel() < numel:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"emulated symmetric buffer {key} grows during CUDA graph capture")
            if buf is not None:
                self.retired.append(buf)
            buf = torch.zeros(numel, dtype=dtype, device=device)
            pad = torch.zeros(self.pad_numel, dtype=torch.int32, device=device)
            torch.cuda.current_stream().synchronize()  # zeroed before a peer's kernel may touch them
            self.exchange.setdefault(key, [None] * self.world_size)[rank] = (buf, pad)
            self.rendezvous.wait()
            bufs, pads = zip(*self.exchange[key])
            self.rendezvous.wait()  # everyone read the exchange before a later grow rewrites it
            self.handles[id(buf)] = EmulatedHandle(rank, self.world_size, list(bufs), list(pads), self.cas_spin)
            self.buffers[(key, rank)] = buf
        return buf

    def handle(self, buf):
        return self.handles[id(buf)]

    def side_stream(self, device, role="copy"):
        key = (_RANK.rank, role)
        if key not in self.streams:
            self.streams[key] = torch.cuda.Stream(device=device)
        return self.streams[key]

    def install(self) -> None:
        from tpweave.ops import symm_buffers
        from tpweave.ops.strategies import ce_overlap

        symm_buffers.reserve, symm_buffers.handle = self.reserve, self.handle
        ce_overlap._side_stream = self.side_stream


_WORLD: list[EmulatedWorld] = []  # the child process's world (one per process)


def capture_graph(fn):
    """Every rank captures fn at the same time (no rank's device-wide sync may meet another's capture;
    thread-local capture mode: the other ranks keep launching)."""
    world = _WORLD[0]
    torch.cuda.synchronize()
    world.capture_barrier.wait()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            out = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    world.capture_barrier.wait()
    return graph, out


def _child(world_size, fn, args, conn):
    world = EmulatedWorld(world_size)
    _WORLD.append(world)
    world.install()
    results, errors = [None] * world_size, {}

    def rank_main(rank):
        _RANK.rank = rank
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                results[rank] = fn(EmulatedContext(rank, world_size), *args)
                torch.cuda.current_stream().synchronize()
        except BaseException:
            errors[rank] = traceback.format_exc()
            world.rendezvous.abort()
            world.capture_barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) and not errors:
        threads[0].join(0.2)
    if errors:
        conn.send(("error", errors))
        conn.close()
        os._exit(1)  # a peer may spin on the GPU forever
    conn.send(("ok", results))
    conn.close()


def run(world_size: int, fn, *args, timeout_s: float = 600):
    """[fn(ctx, *args) for every emulated rank]; raises with the failing rank's traceback, or on timeout
    (a deadlocked protocol)."""
    env_before = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    # one hardware queue per stream: with the default 8, one rank's spinning kernel could sit in front
    # of the peer's signal in a shared queue (a false dependency between two "GPUs")
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "32"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(world_size, fn, args, child), daemon=True)
    try:
        proc.start()
    finally:
        if env_before is None:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS")
        else:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = env_before
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise TimeoutError(f"{world_size} emulated ranks did not finish {fn.__name__} in {timeout_s:.0f} s: a protocol deadlock")
        status, payload = parent.recv()
    except EOFError:
        raise RuntimeError(f"the emulation process died (exit code {proc.exitcode})") from None
    finally:
        proc.kill()
        proc.join()
    if status == "error":
        raise RuntimeError("emulated rank(s) failed:\n" + "\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(payload.items())))
    return payload
