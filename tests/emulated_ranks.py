"""Several TP ranks on ONE GPU, one process each, for the symmetric-memory protocols of tpweave's own
kernels (ce_overlap, triton_ar_norm*): torch's symmetric-memory allocator refuses two ranks on one
device, and a protocol bug (a slot overwritten while a peer reads it, a signal sent twice, a wrong
offset) would otherwise only show on a multi-GPU machine, as a hang or wrong numbers.

`symm_buffers.reserve` is replaced by buffers and signal pads in ordinary device memory
that every rank maps through CUDA IPC (rendezvous = a gloo all-gather of the IPC handles, at the
same point of each rank's program as torch's), with torch's layout (pad[channel * world + src]) and
semantics (put_signal: compare-and-swap 0 -> 1 with release, spinning while the slot is still set;
wait_signal: 1 -> 0 with acquire; barrier: signal every peer, then wait for every peer). The ranks'
CUDA contexts share the GPU by time slices, so a rank spinning on a signal gives way to its peer.
What it checks: slot sizes and offsets, the order of pushes, signals and reads, buffer reuse over
back-to-back calls and CUDA-graph replays, any M and world size. What it cannot: the weaker ordering
of NVLink between GPUs, and any timing.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import math

import torch
import torch.distributed as dist

import tpweave

try:
    import triton
    import triton.language as tl

    from tpweave.ops.strategies.triton_ar_norm import _send_signal, _stop_if_late, _wait_signal

    @triton.jit
    def _signal_kernel(slot_ptr, timeout_ms, WAIT: tl.constexpr):
        addrs = slot_ptr + tl.zeros([1], dtype=tl.int32)
        timeout_ns = tl.full([1], timeout_ms, tl.int64) * 1000000
        one = tl.full([1], 1, tl.int32)  # one thread: a second CAS 0 -> 1 would spin until the slot is consumed
        if WAIT:
            late = _wait_signal(addrs, timeout_ns, one)
        else:
            late = _send_signal(addrs, timeout_ns, one)
        _stop_if_late(tl.max(late, axis=0), tl.program_id(0), 0)
except ImportError:  # CPU-only machines never run the emulation
    _signal_kernel = None


class EmulatedHandle:
    """What tpweave's kernels use of torch's symmetric-memory handle."""

    def __init__(self, rank: int, world_size: int, bufs: list[torch.Tensor], pads: list[torch.Tensor], signal):
        self.rank, self.world_size = rank, world_size
        self._bufs, self._pads, self._signal = bufs, pads, signal
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

    # timeout_ms: torch's 0 waits forever; a kernel that times out prints and traps, as torch's do
    def put_signal(self, dst_rank: int, channel: int = 0, timeout_ms: int = 0) -> None:
        slot = channel * self.world_size + self.rank
        self._signal[(1,)](self._pads[dst_rank][slot : slot + 1], timeout_ms or 2**31 - 1, WAIT=False, num_warps=1)

    def wait_signal(self, src_rank: int, channel: int = 0, timeout_ms: int = 0) -> None:
        slot = channel * self.world_size + src_rank
        self._signal[(1,)](self._pads[self.rank][slot : slot + 1], timeout_ms or 2**31 - 1, WAIT=True, num_warps=1)

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        peers = [r for r in range(self.world_size) if r != self.rank]
        for peer in peers:
            self.put_signal(peer, channel, timeout_ms)
        for peer in peers:
            self.wait_signal(peer, channel, timeout_ms)


class EmulatedSymmetricMemory:
    """This rank's buffers and handles; `install` puts it in place of symm_buffers.reserve."""

    def __init__(self, rank: int, world_size: int):
        from torch._C._distributed_c10d import _SymmetricMemory

        self.rank, self.world_size = rank, world_size
        self.pad_numel = getattr(_SymmetricMemory, "signal_pad_size", 2048) // 4
        self.buffers: dict[tuple, object] = {}  # key -> symm_buffers.SymmBuffer
        self.retired: list[object] = []
        self.signal = _signal_kernel

    def reserve(self, group_name, numel, dtype, device, *, tag="staging"):
        from torch.multiprocessing.reductions import reduce_tensor

        from tpweave.ops.symm_buffers import SymmBuffer, outside_graph_pools

        key = (group_name, dtype, torch.device(device), tag)
        held = self.buffers.get(key)
        if held is None or held.tensor.numel() < numel:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"emulated symmetric buffer {key} grows during CUDA graph capture")
            if held is not None:
                self.retired.append(held)
            # outside every CUDA graph pool, as torch's symmetric allocator is (symm_buffers.outside_graph_pools)
            buf, pad = outside_graph_pools(
                lambda: (
                    torch.zeros(numel, dtype=dtype, device=device),
                    torch.zeros(self.pad_numel, dtype=torch.int32, device=device),
                ),
                torch.device(device),
            )  # zeroed (synchronized) before a peer's kernel may touch them
            shared = [None] * self.world_size
            dist.all_gather_object(shared, (reduce_tensor(buf), reduce_tensor(pad)))
            bufs, pads = [], []
            for r, ((rebuild_buf, buf_args), (rebuild_pad, pad_args)) in enumerate(shared):
                bufs.append(buf if r == self.rank else rebuild_buf(*buf_args))
                pads.append(pad if r == self.rank else rebuild_pad(*pad_args))
            handle = outside_graph_pools(  # its device pointer tables too
                lambda: EmulatedHandle(self.rank, self.world_size, bufs, pads, self.signal), torch.device(device)
            )
            held = self.buffers[key] = SymmBuffer(buf, handle)
        return held

    def install(self) -> None:
        from tpweave.ops import symm_buffers

        symm_buffers.reserve = self.reserve


def collectives_through_the_host(dispatch_key: str = "CUDA") -> torch.library.Library:
    """The functional collectives' CUDA kernels (what compiled graphs and tpweave's ops call) replaced by: a copy to
    the host, gloo's collective there, a copy back. gloo takes few collectives of CUDA tensors (an all-gather of them
    killed the rank with SIGSEGV); eager calls only, a CUDA graph cannot capture these. Kept while the Library
    object lives."""
    from torch.distributed.distributed_c10d import _resolve_process_group as group_of

    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

    def all_reduce_(x, op, group_name):
        host = x.cpu()
        dist.all_reduce(host, op=ops[op.lower()], group=group_of(group_name))
        return x.copy_(host)

    def all_reduce(x, op, group_name):
        return all_reduce_(x.clone(), op, group_name)

    def all_gather_into_tensor(x, world_size, group_name):
        out = torch.empty((world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype)
        dist.all_gather_into_tensor(out, x.contiguous().cpu(), group=group_of(group_name))
        return out.to(x.device)

    def reduce_scatter_tensor(x, op, world_size, group_name):
        host = x.contiguous().cpu()
        dist.all_reduce(host, op=ops[op.lower()], group=group_of(group_name))
        rows = x.shape[0] // world_size
        rank = dist.get_rank(group_of(group_name))
        return host[rank * rows : (rank + 1) * rows].to(x.device)

    def all_to_all_single(x, output_split_sizes, input_split_sizes, group_name):
        out = torch.empty((sum(output_split_sizes), *x.shape[1:]), dtype=x.dtype)
        dist.all_to_all_single(out, x.contiguous().cpu(), output_split_sizes, input_split_sizes,
                               group=group_of(group_name))  # fmt: skip
        return out.to(x.device)

    lib = torch.library.Library("_c10d_functional", "IMPL")
    for fn in (all_reduce_, all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single):
        lib.impl(fn.__name__, fn, dispatch_key)
    return lib


def _emulated_rank(ctx, fn, args, timeout_s, host_collectives):
    faulthandler.enable()  # a crashing rank shows where
    faulthandler.dump_traceback_later(max(1.0, timeout_s - 10))  # where a deadlocked rank waits, before launch kills it
    torch.cuda.set_device(0)
    EmulatedSymmetricMemory(ctx.rank, ctx.world_size).install()
    staged = collectives_through_the_host() if host_collectives else None
    # the rank's TPContext (gloo group: host rendezvous and any plain collective) on the one GPU
    out = fn(dataclasses.replace(ctx, device=torch.device("cuda", 0)), *args)
    del staged
    return out


def run(
    world_size: int,
    fn,
    *args,
    timeout_s: float = 600,
    collective_timeout_s: float = 120,
    host_collectives: bool = False,
):
    """[fn(ctx, *args) for every emulated rank] (ctx.device: the one GPU); a rank's error or a timeout
    (a deadlocked protocol) raises, as in tpweave.launch. collective_timeout_s: the gloo group's
    timeout, which is also how long the kernels wait for a peer's signal. host_collectives: the functional
    collectives run through the host (`collectives_through_the_host`), for models whose collectives are plain ones,
    run without CUDA graphs."""
    return tpweave.launch(
        _emulated_rank,
        fn,
        args,
        timeout_s,
        host_collectives,
        nprocs=world_size,
        backend="gloo",
        timeout_s=timeout_s,
        collective_timeout_s=collective_timeout_s,
    )
