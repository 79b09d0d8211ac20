"""Programmatic dependent launch (PDL, sm_90 and later): a kernel launched with it is let onto the GPU while the
kernel before it in the stream finishes, and waits (griddepcontrol.wait) for that kernel's completion and memory
before it reads anything that kernel may write. Before the wait it may read only what no kernel still running
writes: the GEMV loads its first tile of weights there, the paged decode kernel its first tile of cached K/V
(written by earlier steps). Launch latency, index setup and those loads overlap the kernel before; the results
are those of a plain launch.

A kernel lets the next one launch only after its own wait (`wait_and_release`): a kernel then starts only once
the one two places before it has finished, which is what the loads before a wait (and Inductor's kernels, which
wait only for the kernel just before) rely on.

In a decode step of small kernels back to back (the GEMVs, RoPE, paged decode and merge: ~9 per layer), the gap
between two kernels is a visible share of the step. tpweave's decode kernels launch so where `enabled`, and
tpweave's compiles ask Inductor to launch its own kernels so (compiler/options.py). TPWEAVE_PDL=0 turns both off.

A kernel takes a `PDL: tl.constexpr` and calls `wait_and_release(PDL)` before its first read of another kernel's
output; its launch passes `launch_pdl=PDL`.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no Triton, or one without PDL: plain launches (the PDL branch below is never compiled)
    gdc_wait = gdc_launch_dependents = None


def requested() -> bool:
    """Whether PDL is wanted at all: TPWEAVE_PDL unset, or set to anything but 0."""
    return os.environ.get("TPWEAVE_PDL", "1").strip() != "0"


def enabled(device: torch.device) -> bool:
    """Whether tpweave's kernels on this device launch with PDL: requested, Triton has it, a CUDA GPU of sm_90+."""
    if gdc_wait is None or device.type != "cuda" or not requested():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


if triton is not None:

    @triton.jit
    def wait_and_release(PDL: tl.constexpr):
        """With PDL: wait for the kernel before this one (its writes visible), then let the next one launch (it
        waits in turn before reading what this kernel writes)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
