"""tpweave's copy-engine overlap: all-gather + matmul and matmul + reduce-scatter as two-stream
pipelines over symmetric memory (cuBLAS GEMMs on the caller's stream, NVLink copies on a side stream).

ag_mm: each rank pushes its token shard into a receive slot of every peer by copy engine and signals
it, while the GEMM of its own rows runs; the GEMM of a peer's rows starts once that peer's signal
arrived (`ce_overlap_2s`: those GEMMs on a second compute stream, overlapping the previous one's
tail). mm_rs: the rows the peers own are multiplied first and pushed into their receive slots while
the own rows are multiplied; the own rows' partial sums are added once every peer signalled (in the
residual add + RMSNorm kernel that follows, where the graph has one: `mm_rs_rms_norm`).
Compared with torch's fused ops: no copy of the shard into a staging buffer, one barrier instead of
three, and (mm_rs) a push of finished rows instead of an all-to-all of every partial result.

Buffer reuse: each op opens with a barrier on the side stream. A rank's side stream reaches it only
after its caller's stream finished the previous op (which read the slots), so no rank writes a slot
a peer still reads. Signal channels of the buffer's pad: 0 = that barrier, 1 = "your slot is filled".
CUDA only, P2P-reachable peers; elsewhere `pick` falls back to `sequential`.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from tpweave.ops import rms_norm, symm_buffers
from tpweave.ops.overlap import Strategy, register

_BARRIER, _FILLED = 0, 1


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device, role: str = "copy") -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)


def _available(x: Tensor) -> bool:
    return x.is_cuda and symm_buffers.has_symm_mem_ops()


def _slots(group_name: str, world_size: int, rows: int, width: int, like: Tensor):
    """(handle, [this rank's receive slot of each source rank]); a slot holds (rows, width)."""
    buf = symm_buffers.reserve(group_name, world_size * rows * width, like.dtype, like.device, tag="ce_overlap")
    handle = symm_buffers.handle(buf)
    return handle, [buf[r * rows * width : (r + 1) * rows * width].view(rows, width) for r in range(world_size)]


def _token_range(rank: int, rows: int, num_tokens: int) -> tuple[int, int]:
    """Rows [lo, hi) of the full token dim that `rank`'s shard holds (hi - lo < rows for the padded tail)."""
    lo = min(rank * rows, num_tokens)
    return lo, min(lo + rows, num_tokens)


def _ag_mm(x_local, weights, biases, token_sizes, group_name, world_size, *, need_gathered: bool, overlap_gemms: bool):
    """overlap_gemms: the peers' GEMMs run on a second compute stream, so each can start while the
    previous one's last wave still runs (a split GEMM's tail costs less); else one after another."""
    num_tokens, (rows, k) = math.prod(token_sizes), x_local.shape
    x_local = x_local.contiguous()
    handle, slots = _slots(group_name, world_size, rows, k, x_local)
    rank = handle.rank
    main, side = torch.cuda.current_stream(), _side_stream(x_local.device)
    outs = [x_local.new_empty(num_tokens, w.shape[1]) for w in weights]
    gathered = x_local.new_empty(num_tokens, k)

    side.wait_stream(main)
    with torch.cuda.stream(side):
        handle.barrier(channel=_BARRIER)
        for step in range(1, world_size):
            peer = (rank - step) % world_size  # the peer that multiplies this shard at its `step`
            handle.get_buffer(peer, (rows, k), x_local.dtype, rank * rows * k).copy_(x_local)
            handle.put_signal(peer, channel=_FILLED)

    def multiply(src: int, a_rows: Tensor) -> None:
        lo, hi = _token_range(src, rows, num_tokens)
        if hi == lo:
            return
        a_rows = a_rows[: hi - lo]
        for out, w, b in zip(outs, weights, biases):
            if b is None:
                torch.mm(a_rows, w, out=out[lo:hi])
            else:
                torch.addmm(b, a_rows, w, out=out[lo:hi])
        if need_gathered:
            gathered[lo:hi].copy_(a_rows)

    compute = _side_stream(x_local.device, "compute") if overlap_gemms else main
    compute.wait_stream(main)
    multiply(rank, x_local)
    with torch.cuda.stream(compute):
        for step in range(1, world_size):
            src = (rank + step) % world_size
            handle.wait_signal(src, channel=_FILLED)
            multiply(src, slots[src])
    main.wait_stream(compute)
    main.wait_stream(side)
    return [gathered.view(*token_sizes, k), *outs]


def ag_mm(x_local, weights, biases, token_sizes, group_name, world_size, *, need_gathered=True):
    return _ag_mm(x_local, weights, biases, token_sizes, group_name, world_size, need_gathered=need_gathered, overlap_gemms=False)


def ag_mm_overlapped_gemms(x_local, weights, biases, token_sizes, group_name, world_size, *, need_gathered=True):
    return _ag_mm(x_local, weights, biases, token_sizes, group_name, world_size, need_gathered=need_gathered, overlap_gemms=True)


def _mm_rs_partials(a, weight, group_name, world_size) -> tuple[Tensor, list[Tensor]]:
    """(this rank's own partial rows, the partial rows every peer pushed here), all (rows, H); the
    caller's stream has waited for every push."""
    num_tokens, h = a.shape[0], weight.shape[1]
    rows = -(-num_tokens // world_size)
    handle, slots = _slots(group_name, world_size, rows, h, a)
    rank = handle.rank
    main, side = torch.cuda.current_stream(), _side_stream(a.device)

    def partial(dst: int) -> Tensor:
        """(rows, H): a's rows of `dst`'s shard times weight, zero rows for the padded tail."""
        lo, hi = _token_range(dst, rows, num_tokens)
        out = a.new_empty(rows, h)
        if hi > lo:
            torch.mm(a[lo:hi], weight, out=out[: hi - lo])
        if hi - lo < rows:
            out[hi - lo :].zero_()
        return out

    side.wait_stream(main)
    with torch.cuda.stream(side):
        handle.barrier(channel=_BARRIER)
    in_flight = []  # kept until the streams join: the allocator must not hand them to the next GEMM
    for step in range(1, world_size):
        peer = (rank + step) % world_size
        rows_for_peer = partial(peer)
        in_flight.append(rows_for_peer)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            handle.get_buffer(peer, (rows, h), a.dtype, rank * rows * h).copy_(rows_for_peer)
            handle.put_signal(peer, channel=_FILLED)
    own = partial(rank)
    received = []
    for step in range(1, world_size):
        src = (rank - step) % world_size  # in the order the peers pushed
        handle.wait_signal(src, channel=_FILLED)
        received.append(slots[src])
    main.wait_stream(side)
    return own, received


def mm_rs(a, weight, group_name, world_size):
    own, received = _mm_rs_partials(a, weight, group_name, world_size)
    for slot in received:
        own.add_(slot)
    return own


def mm_rs_rms_norm(a, weight, residual, norm_weight, eps, weight_in_fp32, group_name, world_size):
    """mm_rs whose last reduction step is the residual add + RMSNorm kernel's second summand."""
    own, received = _mm_rs_partials(a, weight, group_name, world_size)
    for slot in received[:-1]:
        own.add_(slot)
    return rms_norm.add_rms_norm(own, residual, norm_weight, eps=eps, weight_in_fp32=weight_in_fp32,
                                 s2=received[-1] if received else None)


CE_OVERLAP = register(Strategy("ce_overlap", ag_mm=ag_mm, mm_rs=mm_rs, mm_rs_rms_norm=mm_rs_rms_norm, available=_available,
                              cudagraph_trees_safe=False))
# The same pipeline with the peers' GEMMs on a second compute stream (all-gather side only: for mm_rs a
# concurrent own-rows GEMM would only delay the push).
CE_OVERLAP_2S = register(Strategy("ce_overlap_2s", ag_mm=ag_mm_overlapped_gemms, available=_available, cudagraph_trees_safe=False))
