"""StagedInputs: a CUDA graph's static inputs in one device buffer, written on the host and sent in one copy.

A step's inputs (token ids, positions, KV slots, block tables, ...) copied field by field cost a copy each on the
device's stream, and from pageable memory a staging copy each on the host: between two decode-graph replays those
small copies, and the kernels that filled in pending tokens, were the step's time beyond its forward. Here every
field is a view into one byte buffer on the device, mirrored by a buffer of pinned host memory: the host writes a
step's fields into numpy views of the mirror, then `upload()` sends all of it in one copy that does not block.

Two host buffers alternate, so a step can write its inputs while the copy of the step before may not have run yet;
before writing one again the host waits for the copy that last read it (an event: already passed in the engine,
whose host reads step N's tokens before it launches step N + 2).
"""

from __future__ import annotations

import math

import numpy as np
import torch

ALIGN = 16  # bytes: each field's offset, so that every dtype's view of the buffer is aligned


class StagedInputs:
    """Named tensors of fixed shapes and dtypes, on `device` in one buffer (`dev[name]`), filled from the host."""

    def __init__(self, fields: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        offsets, end = {}, 0
        for name, (shape, dtype) in fields.items():
            offsets[name] = end
            end += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
        self.nbytes = end
        self._offsets, self._fields = offsets, fields
        self._device_buf = torch.zeros(end, dtype=torch.uint8, device=device)
        pinned = self._device_buf.is_cuda
        self._host_bufs = [torch.zeros(end, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._slot = 0

        def views(buf: torch.Tensor) -> dict[str, torch.Tensor]:
            return {
                name: buf[offsets[name] : offsets[name] + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                for name, (shape, dtype) in fields.items()
            }

        self.dev = views(self._device_buf)
        # numpy views of each host buffer (bool included: numpy's bool is one byte, like torch's)
        self._host = [{k: v.numpy() for k, v in views(b).items()} for b in self._host_bufs]

    def host(self) -> dict[str, np.ndarray]:
        """The fields on the host, to write the next upload into (numpy views of the free host buffer). Values
        left by an earlier step stay: write every element a graph reads."""
        event = self._events[self._slot]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer has run
        return self._host[self._slot]

    def end_of(self, name: str, rows: int) -> int:
        """The byte where the first `rows` rows of field `name` end: upload(that) sends the fields before it and
        those rows."""
        shape, dtype = self._fields[name]
        return self._offsets[name] + rows * math.prod(shape[1:]) * dtype.itemsize

    def upload(self, nbytes: int | None = None) -> None:
        """Copy what was written into `host()` (its first `nbytes` bytes; all of it by default) to the device
        fields, without blocking the host, on the current stream (before the work queued behind it)."""
        n = self.nbytes if nbytes is None else nbytes
        self._device_buf[:n].copy_(self._host_bufs[self._slot][:n], non_blocking=True)
        if self._device_buf.is_cuda:
            event = torch.cuda.Event()
            event.record()
            self._events[self._slot] = event
        self._slot ^= 1
