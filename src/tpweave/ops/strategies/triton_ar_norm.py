"""tpweave's fused all-reduce + residual add + RMSNorm: one Triton kernel over symmetric memory.

For the small M of decode steps, where an all-reduce is pure latency and the add + norm after it is
one more launch. Each program owns rows pid, pid + G, ...:
  1. copies its rows of the local partial sum into this rank's symmetric buffer,
  2. block-wise barrier with the same program on every peer (signal pads, release/acquire at system
     scope: the peers' rows are written before anyone reads them),
  3. reads the rows from every rank's buffer over NVLink (peer loads, no multicast), sums them in
     rank order (every rank gets the same bits), adds the residual, normalizes, stores y and h,
  4. barrier again: no rank overwrites its buffer (next call) while a peer still reads it.
`triton_ar_norm_ll` needs no barrier (Lamport-style: rows pushed into the peers' buffers, readers spin
on a sentinel value; up to LAMPORT_MAX_ROWS rows). See `_fused_all_reduce_rms_norm`.
CUDA only (P2P-reachable peers); the CPU path of `tpweave::all_reduce_rms_norm` is the composed one.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from tpweave.ops import rms_norm, symm_buffers
from tpweave.ops.strategies import sequential
from tpweave.ops.strategies.contract import Strategy, compose_all_reduce_rms_norm

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_PROGRAMS = 128  # at most one per SM; more only queue behind the barrier
LAMPORT_MAX_ROWS = 1024  # above: triton_ar_norm_ll runs the two-barrier kernel


@functools.cache
def _max_programs(world_size: int) -> int:
    from torch._C._distributed_c10d import _SymmetricMemory

    pad_bytes = getattr(_SymmetricMemory, "signal_pad_size", 2048)
    return max(1, min(MAX_PROGRAMS, pad_bytes // 4 // world_size))


def _available(x: Tensor) -> bool:
    return (
        triton is not None
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and symm_buffers.has_symm_mem_ops()
    )


if triton is not None:

    @triton.jit
    def _thread_id():
        return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _globaltimer(like):
        # nanoseconds, one reading per element of `like` (int32): a vector, so a reduction over it is uniform
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l, r", [like], dtype=tl.int64, is_pure=False, pack=1
        )

    # The spin loops below run in threads tid < num_active only (thread r holds element r of a WORLD-vector;
    # the other threads hold replicas and must not signal twice): a guard inside the asm, not a Triton
    # `if`, so no value is carried out of a divergent region. They write their result ($0) last: an
    # output may share a register with an input. Operands: $1 slot address, $2 timeout (ns), $3 num_active.
    def _cas_spin_asm(order: str, expected: int, desired: int) -> tl.constexpr:
        """Spin until the slot holds `expected`, swap in `desired` (system scope, `order`); $0: 0, or 1
        when the slot did not hold `expected` within the timeout (a peer that never came)."""
        return tl.constexpr(f"""
            {{
            .reg .u32 %seen, %me;
            .reg .pred %p<3>;
            .reg .u64 %t<2>;
            mov.u32 %me, %tid.x;
            setp.ge.u32 %p2, %me, $3;
            @%p2 bra cas_ok;
            mov.u64 %t0, %globaltimer;
            cas_spin:
                atom.global.{order}.sys.cas.b32 %seen, [$1], {expected}, {desired};
                setp.eq.u32 %p0, %seen, {expected};
                @%p0 bra cas_ok;
                mov.u64 %t1, %globaltimer;
                sub.u64 %t1, %t1, %t0;
                setp.lt.u64 %p1, %t1, $2;
                @%p1 bra cas_spin;
                mov.u32 $0, 1;
                bra cas_done;
            cas_ok:
                mov.u32 $0, 0;
            cas_done:
            }}
            """)

    # send: 0 -> 1 with release (this block's writes are visible first); wait: 1 -> 0 with acquire (the
    # peer's writes are visible after)
    _SEND_SIGNAL_ASM = _cas_spin_asm("release", 0, 1)
    _WAIT_SIGNAL_ASM = _cas_spin_asm("acquire", 1, 0)

    @triton.jit
    def _send_signal(addrs, timeout_ns, num_active):
        return tl.inline_asm_elementwise(
            _SEND_SIGNAL_ASM, "=r, l, l, r", [addrs, timeout_ns, num_active], dtype=tl.int32, is_pure=False, pack=1
        )

    @triton.jit
    def _wait_signal(addrs, timeout_ns, num_active):
        return tl.inline_asm_elementwise(
            _WAIT_SIGNAL_ASM, "=r, l, l, r", [addrs, timeout_ns, num_active], dtype=tl.int32, is_pure=False, pack=1
        )

    @triton.jit
    def _pause():
        return tl.inline_asm_elementwise(
            "nanosleep.u32 1000000; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )

    @triton.jit
    def _trap():
        return tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _stop_if_late(worst, block_id, RANK: tl.constexpr):
        """A peer that died (or runs another program) must not hang this GPU: past the group's timeout
        the kernel prints why and traps, so the process gets a CUDA error instead of spinning forever.
        `worst`: nonzero when a wait of this program timed out (a block-wide reduction: uniform)."""
        if worst > 0:
            if _thread_id() == 0:
                tl.device_print(
                    "tpweave: a peer rank sent no signal within the process group's timeout "
                    "(it died, or the ranks run different programs); this rank, kernel block:",
                    RANK + 0 * block_id,
                    block_id,
                )
            else:
                _pause()  # a trap ends every thread of the kernel: thread 0's message goes first
            _trap()

    @triton.jit
    def _block_barrier(signal_pad_ptrs, block_id, timeout_ms, RANK: tl.constexpr, WORLD: tl.constexpr):
        """Program `block_id` of every rank meets here. Slot (block, src) of each pad: 0 idle, 1 signalled."""
        tl.debug_barrier()
        ranks = tl.arange(0, WORLD)
        pads = signal_pad_ptrs.to(tl.pointer_type(tl.uint64))
        remote_pads = tl.load(pads + ranks).to(tl.pointer_type(tl.uint32))
        local_pad = tl.load(pads + RANK).to(tl.pointer_type(tl.uint32))
        timeout_ns = tl.full([WORLD], timeout_ms, tl.int64) * 1000000
        active = tl.full([WORLD], WORLD, tl.int32)
        late = _send_signal(remote_pads + block_id * WORLD + RANK, timeout_ns, active)
        late += _wait_signal(local_pad + block_id * WORLD + ranks, timeout_ns, active)
        tl.debug_barrier()
        _stop_if_late(tl.max(late, axis=0), block_id, RANK)

    @triton.jit
    def _all_reduce_rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        h_ptr,
        y_ptr,
        buffer_ptrs,
        signal_pad_ptrs,
        num_rows,
        eps,
        timeout_ms,
        H: tl.constexpr,
        BLOCK_H: tl.constexpr,
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        WEIGHT_FP32: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_programs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        bufs = buffer_ptrs.to(tl.pointer_type(tl.uint64))
        own = tl.load(bufs + RANK).to(tl.pointer_type(x_ptr.dtype.element_ty))
        for row in range(pid, num_rows, num_programs):
            offs = row.to(tl.int64) * H + cols
            tl.store(own + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
        _block_barrier(signal_pad_ptrs, pid, timeout_ms, RANK, WORLD)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        for row in range(pid, num_rows, num_programs):
            offs = row.to(tl.int64) * H + cols
            s = tl.zeros([BLOCK_H], dtype=tl.float32)
            for r in tl.static_range(WORLD):
                peer = tl.load(bufs + r).to(tl.pointer_type(x_ptr.dtype.element_ty))
                s += tl.load(peer + offs, mask=mask, other=0.0).to(tl.float32)
            rms_norm._norm_rows(s, res_ptr, w, h_ptr, y_ptr, offs, mask, eps, H, HAS_RESIDUAL, WEIGHT_FP32)
        _block_barrier(signal_pad_ptrs, pid, timeout_ms, RANK, WORLD)


if triton is not None:

    @triton.jit
    def _all_reduce_rms_norm_ll_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        h_ptr,
        y_ptr,
        buffer_ptrs,
        calls_ptr,
        num_rows,
        slot_numel,
        eps,
        timeout_ms,
        H: tl.constexpr,
        BLOCK_H: tl.constexpr,
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        WEIGHT_FP32: tl.constexpr,
        BITS: tl.constexpr,
        SENTINEL: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_programs = tl.num_programs(0)
        epoch = tl.load(calls_ptr + pid) + 1  # the call number, equal across programs and ranks (fixed grid)
        tl.store(calls_ptr + pid, epoch)
        # buffer: 3 slots (calls cycle through them) x WORLD sources x rows of H; slot_numel per slot
        slot_base = (epoch % 3).to(tl.int64) * slot_numel
        src_numel = slot_numel.to(tl.int64) // WORLD
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        dtype = x_ptr.dtype.element_ty
        bufs = buffer_ptrs.to(tl.pointer_type(tl.uint64))
        own = tl.load(bufs + RANK).to(tl.pointer_type(dtype))
        sentinel = tl.full([BLOCK_H], SENTINEL, BITS).to(dtype, bitcast=True)
        timeout_ns = tl.full([BLOCK_H], timeout_ms, tl.int64) * 1000000
        # push this rank's rows into every peer's slot (+0.0 turns -0.0, the sentinel, into +0.0)
        for row in range(pid, num_rows, num_programs):
            offs = row.to(tl.int64) * H + cols
            xv = (tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) + 0.0).to(dtype)
            for r in tl.static_range(WORLD):
                if r != RANK:
                    peer = tl.load(bufs + r).to(tl.pointer_type(dtype))
                    tl.store(peer + slot_base + RANK * src_numel + offs, xv, mask=mask)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        for row in range(pid, num_rows, num_programs):
            offs = row.to(tl.int64) * H + cols
            s = tl.zeros([BLOCK_H], dtype=tl.float32)
            for r in tl.static_range(WORLD):
                if r == RANK:
                    s += tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) + 0.0
                else:
                    src = own + slot_base + r * src_numel + offs
                    got = tl.load(src, mask=mask, other=0.0, volatile=True)
                    # each element arrives on its own: spin until none is the sentinel any more.
                    # state: 1 while some element is the sentinel, 3 once one still is after the timeout
                    state = tl.max((got.to(BITS, bitcast=True) == SENTINEL).to(tl.int32), axis=0)
                    if state == 1:  # uniform; the clock is read only when the data is not there yet
                        start = _globaltimer(cols)
                        while state == 1:
                            got = tl.load(src, mask=mask, other=0.0, volatile=True)
                            late = ((_globaltimer(cols) - start) > timeout_ns).to(tl.int32)
                            state = tl.max(
                                (got.to(BITS, bitcast=True) == SENTINEL).to(tl.int32) * (1 + 2 * late), axis=0
                            )
                        _stop_if_late(state // 2, pid, RANK)
                    s += got.to(tl.float32)
                    tl.store(src, sentinel, mask=mask)  # ready for call epoch + 3
            rms_norm._norm_rows(s, res_ptr, w, h_ptr, y_ptr, offs, mask, eps, H, HAS_RESIDUAL, WEIGHT_FP32)


def _fixed_grid(num_rows: int, world_size: int) -> int:
    """Programs of a triton_ar_norm_ll call: a power of two >= the rows (at most the pad's limit). Each
    grid size has its own buffer, pads and counters, so the grid of a buffer never changes."""
    return min(triton.next_power_of_2(max(num_rows, 1)), _max_programs(world_size))


def _kernel_takes(x: Tensor, residual: Tensor | None, weight: Tensor, world_size: int) -> bool:
    """Whether the fused kernels take these inputs (else the composed form runs): TP a power of 2, what the norm
    kernel takes, a residual of x's dtype."""
    return (
        world_size & (world_size - 1) == 0
        and rms_norm.triton_supported(x, weight)
        and (residual is None or residual.dtype == x.dtype)
    )


def _prepare(x: Tensor, residual: Tensor | None, weight: Tensor, weight_in_fp32: bool, world_size: int):
    """(x contiguous, its rows, y and h allocated, the kernels' five tensor arguments, their shared meta)."""
    hidden = x.shape[-1]
    x = x.contiguous()
    h = torch.empty_like(x)
    y = torch.empty(x.shape, dtype=rms_norm.out_dtype(x, weight, weight_in_fp32), device=x.device)
    tensors = (x, x if residual is None else residual.contiguous(), weight.contiguous(), h, y)
    meta = dict(
        H=hidden,
        BLOCK_H=rms_norm.block_h(hidden),
        WORLD=world_size,
        HAS_RESIDUAL=residual is not None,
        WEIGHT_FP32=weight_in_fp32,
        num_warps=rms_norm.num_warps_for(hidden),
    )
    return x, x.numel() // hidden, y, h, tensors, meta


def _launch_two_barriers(buf, tensors: tuple, num_rows: int, eps: float, timeout_ms: int, meta: dict, programs: int):
    """`_all_reduce_rms_norm_kernel` over buffer `buf` on the current stream, on at most `programs` programs."""
    _all_reduce_rms_norm_kernel[(max(1, min(num_rows, programs)),)](
        *tensors,
        buf.handle.buffer_ptrs_dev,
        buf.handle.signal_pad_ptrs_dev,
        num_rows,
        eps,
        timeout_ms,
        RANK=buf.handle.rank,
        **meta,
    )


def _fused_all_reduce_rms_norm(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float,
    weight_in_fp32: bool,
    group_name: str,
    world_size: int,
    *,
    protocol: str,
) -> tuple[Tensor, Tensor]:
    """protocol "two_barriers": `_all_reduce_rms_norm_kernel` (barrier, sum, barrier again before the
    buffer is reused). "lamport": `_all_reduce_rms_norm_ll_kernel`, no
    barrier: each rank stores its rows into every peer's buffer, which holds a sentinel (-0.0) wherever
    no data is due; a reader spins until none of its elements is the sentinel, then writes the
    sentinel back. Three slots used in turn: a peer can be at most one call ahead, and a slot's next
    writer (call k + 3) has seen this rank's data of calls k + 1 and k + 2, stored after the reset."""
    if not _kernel_takes(x, residual, weight, world_size):
        return compose_all_reduce_rms_norm(
            sequential.all_reduce, x, residual, weight, eps, weight_in_fp32, group_name, world_size
        )
    x, num_rows, y, h, tensors, meta = _prepare(x, residual, weight, weight_in_fp32, world_size)
    if not num_rows:
        return y, h
    timeout_ms = symm_buffers.wait_timeout_ms(group_name)
    if protocol == "lamport" and num_rows > LAMPORT_MAX_ROWS:
        protocol = "two_barriers"  # its buffer holds 3 x TP copies of the rows: a decode-size protocol
    if protocol == "two_barriers":
        buf = symm_buffers.reserve(group_name, x.numel(), x.dtype, x.device, tag="ar_norm")
        _launch_two_barriers(buf, tensors, num_rows, eps, timeout_ms, meta, _max_programs(world_size))
        return y, h
    grid = _fixed_grid(num_rows, world_size)
    buf = symm_buffers.reserve(
        group_name, 3 * world_size * x.numel(), x.dtype, x.device, tag=f"ar_norm_{protocol}_{grid}"
    )
    handle = buf.handle
    bits, sentinel = _SENTINEL[x.element_size()]
    calls = buf.state.get("calls")  # per-program call counters
    if calls is None:  # a new buffer (never during capture: reserve refuses to grow then)
        calls = buf.state["calls"] = symm_buffers.outside_graph_pools(
            lambda: torch.zeros(grid, dtype=torch.int32, device=x.device), x.device
        )
        buf.tensor.view(bits).fill_(sentinel)  # every element the sentinel on every rank before any peer stores data
        handle.barrier(channel=0, timeout_ms=timeout_ms)
    _all_reduce_rms_norm_ll_kernel[(grid,)](
        *tensors,
        handle.buffer_ptrs_dev,
        calls,
        num_rows,
        buf.tensor.numel() // 3,
        eps,
        timeout_ms,
        RANK=handle.rank,
        BITS=_TL_BITS[bits],
        SENTINEL=sentinel,
        **meta,
    )
    return y, h


def side_stream_supported(device: torch.device, dtype: torch.dtype, world_size: int) -> bool:
    """Whether `start_on_side_stream` runs the fused kernel (not the composed, synchronous form) for inputs
    of this device and dtype in a group of `world_size` ranks."""
    return (
        triton is not None
        and device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16, torch.float32)
        and world_size & (world_size - 1) == 0
        and symm_buffers.has_symm_mem_ops()
    )


def start_on_side_stream(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float,
    weight_in_fp32: bool,
    group_name: str,
    world_size: int,
    *,
    num_programs: int,
) -> tuple[Tensor, Tensor]:
    """(y, h) of the all-reduce + residual + RMSNorm of x, computed by `_all_reduce_rms_norm_kernel` on at most
    `num_programs` SMs on a side stream, so that the current stream's next kernels (the other token subset's
    matmuls) run beside it. y and h are valid on the current stream only after `wait_side_stream`.
    Elsewhere (CPU, a group size that is not a power of 2) the composed form, done when this returns."""
    if not _runs_on_side_stream(x, residual, weight, world_size):
        return compose_all_reduce_rms_norm(
            sequential.all_reduce, x, residual, weight, eps, weight_in_fp32, group_name, world_size
        )
    x, num_rows, y, h, tensors, meta = _prepare(x, residual, weight, weight_in_fp32, world_size)
    if not num_rows:
        return y, h
    buf = symm_buffers.reserve(group_name, x.numel(), x.dtype, x.device, tag="ar_norm_side")
    side = buf.state.get("stream")
    if side is None:
        side = buf.state["stream"] = torch.cuda.Stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))  # x, residual are written on the current stream
    with torch.cuda.stream(side):
        timeout_ms = symm_buffers.wait_timeout_ms(group_name)
        _launch_two_barriers(
            buf, tensors, num_rows, eps, timeout_ms, meta, min(num_programs, _max_programs(world_size))
        )
        done = torch.cuda.Event()
        done.record(side)
    # the kernel's inputs (contiguous copies included) stay alive until the wait: no allocation of the current
    # stream reuses their memory while the side stream still reads it
    buf.state.setdefault("pending", {})[y.data_ptr()] = (done, tensors)
    return y, h


def _runs_on_side_stream(x: Tensor, residual: Tensor | None, weight: Tensor, world_size: int) -> bool:
    return side_stream_supported(x.device, x.dtype, world_size) and _kernel_takes(x, residual, weight, world_size)


def wait_side_stream(
    y: Tensor, x: Tensor, residual: Tensor | None, weight: Tensor, group_name: str, world_size: int
) -> None:
    """Make the current stream wait for the side-stream kernel that writes y (`start_on_side_stream` of the
    same x, residual, weight); nothing when that call computed y in place (the composed form)."""
    if not (x.numel() and _runs_on_side_stream(x, residual, weight, world_size)):
        return
    # the buffer start reserved for x (no new one: x.numel() fitted then)
    buf = symm_buffers.reserve(group_name, x.numel(), x.dtype, x.device, tag="ar_norm_side")
    entry = buf.state.get("pending", {}).pop(y.data_ptr(), None)
    if entry is not None:
        torch.cuda.current_stream(y.device).wait_event(entry[0])


# -0.0 as an integer of the element's width: the "no data yet" value of the lamport buffer
_SENTINEL = {2: (torch.int16, -(2**15)), 4: (torch.int32, -(2**31))}
_TL_BITS = {torch.int16: tl.int16, torch.int32: tl.int32} if triton is not None else {}


TRITON_AR_NORM = Strategy(
    name="triton_ar_norm",
    all_reduce_rms_norm=functools.partial(_fused_all_reduce_rms_norm, protocol="two_barriers"),
    available=_available,
)
# No barrier (decode sizes): chosen only where a calibration table measured it faster.
TRITON_AR_NORM_LL = Strategy(
    name="triton_ar_norm_ll",
    all_reduce_rms_norm=functools.partial(_fused_all_reduce_rms_norm, protocol="lamport"),
    available=_available,
)
