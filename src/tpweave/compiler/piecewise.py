"""Piecewise CUDA graphs: the pieces of a compiled graph between its attention ops, each captured once per
input shape and replayed, the attention ops running eagerly between them (their per-step metadata, the
sequences' lengths and block tables, changes shape every step; everything else depends on M alone).

Inductor cuts the graph at the attention ops (graph partition with `custom_should_partition_ops`, after
tpweave's passes ran on the whole graph, so the pieces already hold the sequence-parallel and async-TP
rewrites) and calls every piece through the wrapper `PiecewiseGraphs.wrap` installs
(`torch._inductor.utils.set_customized_partition_wrappers`, set only while tpweave compiles such a module).

A piece is called with a list of arguments (tensors and the symbolic sizes as ints) and returns a tuple:

    eager:      out = piece(args)                                  (mode "eager": what Inductor generated)
    first call: piece(args) once (warm-up: kernels compiled, workspaces sized; the inputs put back after
    of a key   it, which a piece may overwrite), then captured on a side stream into the shared memory pool,
               then replayed once (the eager ops after it need real values); `key` = the shapes and
               strides of the tensors and the ints
    replay:    copy the arguments that live elsewhere into the captured graph's own inputs, replay,
               return the graph's outputs

What a captured graph reads must sit at the same address on every replay:
- the module's parameters and buffers (`stable`), and the outputs of pieces captured in the same pass,
  are read where they are;
- anything else (what an eager op between two pieces returned, the step's token ids) is copied into
  a buffer of that piece's own, one per argument position, shared by all keys (views of the largest).
A piece's outputs are handed out as tensors that do not own their memory: the pool may reuse it for
other keys' graphs, which never run between a piece and the pieces that read its outputs. So a piece
whose inputs are such outputs of an earlier replay is never captured (the pool does not know they are
in use); a key first met that way runs eagerly (`eager_misses`). Pieces whose inputs come from eager
ops only (the LM head after `tpweave::select_rows`) are captured whenever a new key comes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# Ops that cut the piecewise graphs: opaque to Inductor, shapes that vary per step (ops/attention.py), and the
# selection of the rows whose logits are wanted (the number of sequences, not of tokens).
PIECEWISE_CUT_OPS = (
    "tpweave::attention",
    "tpweave::paged_attention",
    "tpweave::select_rows",
    "tpweave::invariant_attention",  # compiler/invariant.py's swaps
    "tpweave::invariant_paged_attention",
)


def weak_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's memory that does not keep it allocated."""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.tensor([], dtype=t.dtype, device=t.device).set_(alias, t.storage_offset(), t.shape, t.stride())


def _span(t: torch.Tensor) -> int:
    """Elements from t's first to its last, in its strides' layout."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@dataclass
class _Graph:
    """One piece captured for one key: the graph; per argument position the copy-in view it reads (None where
    it reads the argument in place) and the address the argument had when captured; its outputs as tensors
    that do not own their memory, and their storages."""

    graph: torch.cuda.CUDAGraph
    copy_in: list[torch.Tensor | None]
    input_ptrs: list[int | None]
    outputs: tuple
    output_storages: tuple[int, ...]


@dataclass
class _Piece:
    """One partition of one compiled graph: its compiled callable and its graphs by key."""

    owner: PiecewiseGraphs
    fn: Callable[[list], Any]
    index: int
    graphs: dict[tuple, _Graph] = field(default_factory=dict)
    scratch: dict[int, torch.Tensor] = field(default_factory=dict)  # argument position -> its copy-in buffer

    def __call__(self, args: list) -> Any:
        owner = self.owner
        if owner.mode != "graphs":
            return self.fn(args)
        key = tuple((a.shape, a.stride()) if isinstance(a, torch.Tensor) else a for a in args)
        entry = self.graphs.get(key)
        if entry is None:
            if any(isinstance(a, torch.Tensor) and _storage(a) in owner._handed_out for a in args):
                owner.eager_misses += 1  # its inputs are outputs of replays: the pool does not know they are in use
                return self.fn(args)
            return owner._capture(self, key, args)
        for a, dst, ptr in zip(args, entry.copy_in, entry.input_ptrs):
            if ptr is None or a.data_ptr() == ptr:
                continue
            if dst is None:  # read in place when captured, elsewhere now (another key's output): no graph
                owner.eager_misses += 1
                return self.fn(args)
            dst.copy_(a)
        args.clear()
        entry.graph.replay()
        owner.num_replays += 1
        owner._handed_out.update(entry.output_storages)
        return entry.outputs


class PiecewiseGraphs:
    """Piecewise CUDA graphs of the modules compiled with `CompileOptions(piecewise_graphs=...)`: their pieces
    run as compiled in mode "eager" (the default: also inside a CUDA graph captured around the whole call),
    and within `replaying()` from graphs captured per key, in one memory pool shared by every key (`pool`:
    a handle to share, e.g. with other graphs of the same engine). `stable`: a callable giving the tensors
    read in place (the module's parameters and buffers), asked at the first capture."""

    def __init__(self, *, stable: Callable[[], Iterable[torch.Tensor]] | None = None, pool: Any = None):
        self.mode = "eager"
        self.pieces: list[_Piece] = []
        self.pool = pool
        self._stable_fn = stable
        self._stable: set[int] | None = None  # storages of the stable tensors
        self._stream: torch.cuda.Stream | None = None
        self._captured_outputs: set[int] = set()  # storages of what pieces captured in this pass returned
        self._handed_out: set[int] = set()  # storages of outputs that replays in this pass handed out
        self.num_captures = 0
        self.num_replays = 0
        self.eager_misses = 0
        self.capture_s = 0.0

    def wrap(self, fn: Callable[[list], Any], metadata: Any = None) -> Callable[[list], Any]:
        """Inductor's partition wrapper: `fn` (a piece) called through this object."""
        piece = _Piece(self, fn, len(self.pieces))
        self.pieces.append(piece)
        return piece

    @property
    def num_graphs(self) -> int:
        """Graphs captured so far, over all pieces and keys."""
        return sum(len(p.graphs) for p in self.pieces)

    def stats(self) -> dict[str, Any]:
        """Pieces, graphs, captures, replays, eager misses and seconds spent capturing."""
        return {
            "pieces": len(self.pieces),
            "graphs": self.num_graphs,
            "captures": self.num_captures,
            "replays": self.num_replays,
            "eager_misses": self.eager_misses,
            "capture_s": self.capture_s,
        }

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Within: one call of the compiled module, its pieces replayed (or captured for a new key)."""
        self.mode = "graphs"
        self._captured_outputs.clear()
        self._handed_out.clear()
        try:
            yield
        finally:
            self.mode = "eager"
            self._captured_outputs.clear()
            self._handed_out.clear()

    def release(self) -> None:
        """Drop every captured graph and copy-in buffer (pieces run as compiled afterwards)."""
        for piece in self.pieces:
            piece.graphs.clear()
            piece.scratch.clear()

    def _read_in_place(self, t: torch.Tensor) -> bool:
        if self._stable is None:
            tensors = self._stable_fn() if self._stable_fn is not None else ()
            self._stable = {_storage(s) for s in tensors if s is not None}
        return _storage(t) in self._stable or _storage(t) in self._captured_outputs

    def _capture(self, piece: _Piece, key: tuple, args: list) -> Any:
        start = time.perf_counter()
        inputs: list[Any] = []
        copy_in: list[torch.Tensor | None] = []
        for i, a in enumerate(args):
            view = None
            if isinstance(a, torch.Tensor) and not self._read_in_place(a):
                buf = piece.scratch.get(i)
                if buf is None or buf.numel() < _span(a) or buf.dtype != a.dtype or buf.device != a.device:
                    buf = piece.scratch[i] = torch.empty(max(_span(a), 1), dtype=a.dtype, device=a.device)
                view = buf.as_strided(a.shape, a.stride()).copy_(a)
            inputs.append(a if view is None else view)
            copy_in.append(view)
        args.clear()
        # warm-up: first launches (Triton, cuBLAS), workspaces and symmetric buffers sized. A piece may write its
        # outputs over an input it was the last reader of (Inductor reuses such buffers): the inputs it was given are
        # put back before the replay that computes this pass's values.
        stable = self._stable or set()
        kept = [a.clone() if isinstance(a, torch.Tensor) and _storage(a) not in stable else None for a in inputs]
        piece.fn(list(inputs))
        for a, saved in zip(inputs, kept):
            if saved is not None:
                a.copy_(saved)
        del kept
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self.pool)
            try:
                outputs = piece.fn(list(inputs))
            finally:
                graph.capture_end()
        current.wait_stream(self._stream)
        graph.replay()  # real values for the eager ops after this piece
        outputs = tuple(outputs)
        storages = tuple(_storage(t) for t in outputs if isinstance(t, torch.Tensor))
        self._captured_outputs.update(storages)
        ptrs = [a.data_ptr() if isinstance(a, torch.Tensor) else None for a in inputs]
        weak = tuple(weak_alias(t) if isinstance(t, torch.Tensor) else t for t in outputs)
        piece.graphs[key] = _Graph(graph, copy_in, ptrs, weak, storages)
        self.num_captures += 1
        self.capture_s += time.perf_counter() - start
        return outputs  # owning tensors for the rest of this pass: the pool keeps them while they are read
