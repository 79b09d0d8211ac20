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
Every wait ends at the group's collective timeout (torch's signal kernels then print which rank and
channel, and trap): a dead peer stops this process instead of hanging its GPU.
CUDA only, P2P-reachable peers; elsewhere `pick` falls back to `sequential`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from tpweave.ops import rms_norm, symm_buffers
from tpweave.ops.collectives import shard_rows
from tpweave.ops.strategies.contract import Strategy

_BARRIER, _FILLED = 0, 1


@functools.cache
def _side_stream(device: torch.device, role: str = "copy") -> torch.cuda.Stream:
    """One stream per (device, role): "copy" for the pushes and signals, "compute" for ce_overlap_2s."""
    return torch.cuda.Stream(device=device)


def _available(x: Tensor) -> bool:
    return x.is_cuda and symm_buffers.has_symm_mem_ops()


def _slot_stride(rows: int, width: int) -> int:
    """Elements from one receive slot to the next: rounded up so every slot starts 16-byte aligned
    (the FP8 matmuls read (rows, 1) scale slots whose row count may be odd)."""
    return -(-rows * width // 16) * 16


def _slots(group_name: str, world_size: int, rows: int, width: int, like: Tensor):
    """(handle, [this rank's receive slot of each source rank]); a slot holds (rows, width)."""
    stride = _slot_stride(rows, width)
    buf = symm_buffers.reserve(group_name, world_size * stride, like.dtype, like.device, tag="ce_overlap")
    slots = [buf.tensor[r * stride : r * stride + rows * width].view(rows, width) for r in range(world_size)]
    return buf.handle, slots


def _token_range(rank: int, rows: int, num_tokens: int) -> tuple[int, int]:
    """Rows [lo, hi) of the full token dim that `rank`'s shard holds (hi - lo < rows for the padded tail)."""
    lo = min(rank * rows, num_tokens)
    return lo, min(lo + rows, num_tokens)


def _gather_and_consume(
    parts: list[Tensor],
    num_tokens: int,
    group_name: str,
    world_size: int,
    consume: Callable[[int, int, list[Tensor]], None],
    *,
    overlap_gemms: bool,
) -> None:
    """Push this rank's shard tensors `parts` (each (rows, width_i): FP8 rows and their scales, say) into
    every peer's receive slots; call consume(lo, hi, [part rows]) for the own rows at once and for each
    peer's rows once they arrived. Returns with the caller's stream after everything."""
    rows = parts[0].shape[0]  # a shard holds shard_rows(N) >= 2 rows (zero padding past N)
    assert len({p.dtype for p in parts}) == len(parts), "one receive buffer per dtype: parts must differ in dtype"
    widths = [p.numel() // rows for p in parts]
    slots = [_slots(group_name, world_size, rows, width, p) for p, width in zip(parts, widths)]
    handle, rank = slots[0][0], slots[0][0].rank
    timeout_ms = symm_buffers.wait_timeout_ms(group_name)
    main, side = torch.cuda.current_stream(), _side_stream(parts[0].device)

    side.wait_stream(main)
    with torch.cuda.stream(side):
        handle.barrier(channel=_BARRIER, timeout_ms=timeout_ms)
        for step in range(1, world_size):
            peer = (rank - step) % world_size  # the peer that consumes this shard at its `step`
            for part, width, (part_handle, _) in zip(parts, widths, slots):
                offset = rank * _slot_stride(rows, width)
                part_handle.get_buffer(peer, (rows, width), part.dtype, offset).copy_(part.reshape(rows, width))
            handle.put_signal(peer, channel=_FILLED, timeout_ms=timeout_ms)  # after the copies: same stream

    def run(src: int, rows_of_src: list[Tensor]) -> None:
        lo, hi = _token_range(src, rows, num_tokens)
        if hi > lo:
            consume(lo, hi, [t[: hi - lo] for t in rows_of_src])

    compute = _side_stream(parts[0].device, "compute") if overlap_gemms else main
    compute.wait_stream(main)
    run(rank, [p.reshape(rows, width) for p, width in zip(parts, widths)])
    with torch.cuda.stream(compute):
        for step in range(1, world_size):
            src = (rank + step) % world_size
            handle.wait_signal(src, channel=_FILLED, timeout_ms=timeout_ms)
            run(src, [part_slots[src] for _, part_slots in slots])
    main.wait_stream(compute)
    main.wait_stream(side)


def _ag_mm(x_local, weights, biases, token_sizes, group_name, world_size, *, need_gathered: bool, overlap_gemms: bool):
    """overlap_gemms: the peers' GEMMs run on a second compute stream, so each can start while the
    previous one's last wave still runs (a split GEMM's tail costs less); else one after another."""
    num_tokens, k = math.prod(token_sizes), x_local.shape[-1]
    outs = [x_local.new_empty(num_tokens, w.shape[1]) for w in weights]
    gathered = x_local.new_empty(num_tokens, k)

    def consume(lo, hi, parts):
        for out, w, b in zip(outs, weights, biases):
            if b is None:
                torch.mm(parts[0], w, out=out[lo:hi])
            else:
                torch.addmm(b, parts[0], w, out=out[lo:hi])
        if need_gathered:
            gathered[lo:hi].copy_(parts[0])

    _gather_and_consume(
        [x_local.contiguous()], num_tokens, group_name, world_size, consume, overlap_gemms=overlap_gemms
    )
    return [gathered.view(*token_sizes, k), *outs]


def ag_mm(x_local, weights, biases, token_sizes, group_name, world_size, *, need_gathered=True):
    """AgMm as the copy-engine pipeline of the module docstring; each peer's GEMMs run on the caller's stream
    once its rows arrived."""
    return _ag_mm(
        x_local, weights, biases, token_sizes, group_name, world_size, need_gathered=need_gathered, overlap_gemms=False
    )


def ag_mm_overlapped_gemms(x_local, weights, biases, token_sizes, group_name, world_size, *, need_gathered=True):
    """ag_mm with the peers' GEMMs on a second compute stream, each free to start during the previous one's
    tail."""
    return _ag_mm(
        x_local, weights, biases, token_sizes, group_name, world_size, need_gathered=need_gathered, overlap_gemms=True
    )


def ag_scaled_mm(
    x_local,
    x_scale_local,
    weights,
    w_scales,
    biases,
    token_sizes,
    group_name,
    world_size,
    out_dtype,
    *,
    need_gathered=True,
):
    """FP8: the shard's FP8 rows and their (rows, 1) scales travel together; each chunk's scaled matmuls
    start when both arrived."""
    num_tokens, k = math.prod(token_sizes), x_local.shape[-1]
    outs = [x_local.new_empty(num_tokens, w.shape[0], dtype=out_dtype) for w in weights]
    gathered = x_local.new_empty(num_tokens, k)
    gathered_scale = x_scale_local.new_empty(num_tokens, *x_scale_local.shape[1:])

    def consume(lo, hi, parts):
        xq, xs = parts
        for out, w, ws, b in zip(outs, weights, w_scales, biases):
            out[lo:hi].copy_(torch.ops.tpweave.scaled_mm(xq, w, xs, ws, b, out_dtype))
        if need_gathered:
            gathered[lo:hi].copy_(xq)
            gathered_scale[lo:hi].copy_(xs.reshape(hi - lo, *x_scale_local.shape[1:]))

    parts = [x_local.contiguous(), x_scale_local.float().contiguous()]
    _gather_and_consume(parts, num_tokens, group_name, world_size, consume, overlap_gemms=False)
    return [gathered.view(*token_sizes, k), gathered_scale.view(*token_sizes, *x_scale_local.shape[1:]), *outs]


def _produce_and_push(
    num_tokens: int,
    width: int,
    like: Tensor,
    matmul_rows: Callable[[int, int], Tensor],
    group_name: str,
    world_size: int,
) -> tuple[Tensor, list[Tensor]]:
    """(this rank's own partial rows, the partial rows every peer pushed here), all (shard_rows(N), width);
    matmul_rows(lo, hi) computes rows [lo, hi) of the full partial product. The caller's stream has
    waited for every push."""
    rows = shard_rows(num_tokens, world_size)
    handle, slots = _slots(group_name, world_size, rows, width, like)
    rank, timeout_ms = handle.rank, symm_buffers.wait_timeout_ms(group_name)
    main, side = torch.cuda.current_stream(), _side_stream(like.device)

    def partial(dst: int) -> Tensor:
        """(rows, width): the rows of `dst`'s shard, zero rows for the padded tail."""
        lo, hi = _token_range(dst, rows, num_tokens)
        if hi - lo == rows:
            return matmul_rows(lo, hi)
        out = like.new_zeros(rows, width)
        if hi > lo:
            out[: hi - lo].copy_(matmul_rows(lo, hi))
        return out

    side.wait_stream(main)
    with torch.cuda.stream(side):
        handle.barrier(channel=_BARRIER, timeout_ms=timeout_ms)
    in_flight = []  # kept until the streams join: the allocator must not hand them to the next GEMM
    for step in range(1, world_size):
        peer = (rank + step) % world_size
        rows_for_peer = partial(peer)
        in_flight.append(rows_for_peer)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            handle.get_buffer(peer, (rows, width), like.dtype, rank * _slot_stride(rows, width)).copy_(rows_for_peer)
            handle.put_signal(peer, channel=_FILLED, timeout_ms=timeout_ms)
    own = partial(rank)
    received = []
    for step in range(1, world_size):
        src = (rank - step) % world_size  # in the order the peers pushed
        handle.wait_signal(src, channel=_FILLED, timeout_ms=timeout_ms)
        received.append(slots[src])
    main.wait_stream(side)
    return own, received


def _sum(own: Tensor, received: list[Tensor]) -> Tensor:
    for slot in received:
        own.add_(slot)
    return own


def mm_rs(a, weight, group_name, world_size):
    """MmRs as the copy-engine pipeline: the peers' rows are multiplied and pushed first, then the partial
    sums the peers pushed here are added to this rank's own rows."""
    own, received = _produce_and_push(
        a.shape[0], weight.shape[1], a, lambda lo, hi: a[lo:hi] @ weight, group_name, world_size
    )
    return _sum(own, received)


def mm_rs_rms_norm(a, weight, residual, norm_weight, eps, weight_in_fp32, group_name, world_size):
    """mm_rs whose last reduction step is the residual add + RMSNorm kernel's second summand."""
    own, received = _produce_and_push(
        a.shape[0], weight.shape[1], a, lambda lo, hi: a[lo:hi] @ weight, group_name, world_size
    )
    own = _sum(own, received[:-1])
    return rms_norm.add_rms_norm(
        own, residual, norm_weight, eps=eps, weight_in_fp32=weight_in_fp32, s2=received[-1] if received else None
    )


def scaled_mm_rs(a, a_scale, weight, w_scale, group_name, world_size, out_dtype):
    """ScaledMmRs through the same pipeline as mm_rs, each block of rows one scaled matmul in out_dtype."""
    like = a.new_empty(0, dtype=out_dtype)

    def matmul_rows(lo, hi):
        scale = a_scale[lo:hi]
        if scale.data_ptr() % 16:  # the scale vector of a scaled matmul starts 16-byte aligned
            scale = scale.clone()
        return torch.ops.tpweave.scaled_mm(a[lo:hi], weight, scale, w_scale, None, out_dtype)

    return _sum(*_produce_and_push(a.shape[0], weight.shape[0], like, matmul_rows, group_name, world_size))


CE_OVERLAP = Strategy(
    name="ce_overlap",
    ag_mm=ag_mm,
    mm_rs=mm_rs,
    mm_rs_rms_norm=mm_rs_rms_norm,
    ag_scaled_mm=ag_scaled_mm,
    scaled_mm_rs=scaled_mm_rs,
    available=_available,
)
# The same pipeline with the peers' GEMMs on a second compute stream (all-gather side only: for mm_rs a
# concurrent own-rows GEMM would only delay the push).
CE_OVERLAP_2S = Strategy(name="ce_overlap_2s", ag_mm=ag_mm_overlapped_gemms, available=_available)
