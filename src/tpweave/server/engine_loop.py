"""The serving loop every rank runs: the engine stays SPMD under TP.

Rank 0 owns the HTTP front end (server/http.py, in a thread of its own). Its handlers hand new requests and aborts to
this loop through a thread-safe inbox; before every step rank 0 broadcasts what arrived since the last one (a
`Commands`) to every rank, and every rank applies it in the same order, so all schedule the same steps and number the
same sequences. With nothing to run, rank 0 still broadcasts (empty commands) every IDLE_TICK_S seconds, so the other
ranks' wait never reaches the collective timeout. After each step rank 0 hands every request's new tokens to its
sink (a callable the HTTP side gave with the request).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from tpweave.engine import LLMEngine, SamplingParams
from tpweave.engine.sequence import Sequence
from tpweave.runtime.context import TPContext

IDLE_TICK_S = 0.5


@dataclass
class Commands:
    """What every rank applies before a step: requests to add (key, prompt ids, params), keys to abort, and whether
    to stop (after aborting whatever is left)."""

    adds: list[tuple[str, list[int], SamplingParams]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    stop: bool = False

    def __bool__(self) -> bool:
        return bool(self.adds or self.aborts or self.stop)


# what a sink receives: ("tokens", [new ids]) (each after ("logprobs", [their TokenLogprobs]) where the request asked),
# then ("finished", finish_reason) or ("error", message)
Sink = Callable[[tuple[str, Any]], None]


class EngineLoop:
    """Runs `engine` on this rank until stopped (module doc). On rank 0, `submit` / `abort` / `drain` may be called
    from any thread."""

    def __init__(self, ctx: TPContext, engine: LLMEngine, *, on_step: Callable[[LLMEngine], None] | None = None):
        self.ctx, self.engine, self.on_step = ctx, engine, on_step
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, Sink] = {}
        self._seqs: dict[str, Sequence] = {}
        self._sent: dict[str, int] = {}
        self._drain_deadline: float | None = None  # set by drain(): stop once idle, or abort what is left then
        self.num_requests = 0

    # -- rank 0, any thread ---------------------------------------------------------------------------------------
    def submit(self, key: str, prompt: list[int], params: SamplingParams, sink: Sink) -> None:
        """Queue a request under a unique key; its events go to sink (from the loop's thread)."""
        self._inbox.put(("add", key, prompt, params, sink))

    def abort(self, key: str) -> None:
        """End a request (its client left): its KV blocks are freed on every rank at the next step."""
        self._inbox.put(("abort", key))

    def drain(self, grace_s: float) -> None:
        """Stop: finish the requests in flight for up to grace_s seconds, abort the rest, then return from run()."""
        self._inbox.put(("drain", grace_s))

    @property
    def num_active(self) -> int:
        """Requests handed in whose events have not ended."""
        return len(self._sinks)

    # -- every rank ---------------------------------------------------------------------------------------------
    def _collect(self, block: bool) -> Commands:
        """Rank 0: what arrived since the last step (waiting up to IDLE_TICK_S for something when `block`)."""
        cmds = Commands()
        timeout = IDLE_TICK_S if block else 0.0
        while True:
            try:
                item = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
            except queue.Empty:
                break
            timeout = 0.0
            if item[0] == "add":
                _, key, prompt, params, sink = item
                self._sinks[key] = sink
                cmds.adds.append((key, prompt, params))
            elif item[0] == "abort":
                cmds.aborts.append(item[1])
            else:
                self._drain_deadline = time.monotonic() + item[1]
        if self._drain_deadline is not None:
            idle = not self.engine.has_unfinished() and not cmds.adds
            if idle or time.monotonic() >= self._drain_deadline:
                cmds.aborts += [k for k in self._seqs if k not in cmds.aborts]
                cmds.stop = True
        return cmds

    def _share(self, cmds: Commands | None) -> Commands:
        if self.ctx.world_size == 1:
            return cmds
        box = [cmds]
        dist.broadcast_object_list(box, group=self.ctx.group, group_src=0, device=self.ctx.device)
        return box[0]

    def _emit(self, key: str, event: tuple[str, Any]) -> None:
        sink = self._sinks.get(key)
        if sink is not None:
            sink(event)

    def run(self) -> dict[str, Any]:
        """Serve until drained (module doc); this rank's end state: requests served, KV blocks free / total."""
        engine, rank0 = self.engine, self.ctx.rank == 0
        while True:
            cmds = self._share(self._collect(block=not engine.has_unfinished()) if rank0 else None)
            for key, prompt, params in cmds.adds:
                self.num_requests += 1
                try:
                    self._seqs[key] = engine.add_request(prompt, params)
                    self._sent[key] = 0
                except Exception as e:  # noqa: BLE001  (the same on every rank: refused everywhere, the server lives)
                    self._emit(key, ("error", f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)))
                    self._sinks.pop(key, None)
            for key in cmds.aborts:
                seq = self._seqs.pop(key, None)
                if seq is not None:
                    engine.abort(seq)
                self._sent.pop(key, None)
                self._sinks.pop(key, None)
            if cmds.stop:
                break
            if engine.has_unfinished():
                engine.step()
            if rank0:
                self._deliver()
                if self.on_step is not None:
                    self.on_step(engine)
            else:
                self._forget_done()
        while engine.has_unfinished():  # tokens of aborted requests still in flight: read back, dropped
            engine.step()
        blocks = engine.scheduler.blocks
        return {"rank": self.ctx.rank, "requests": self.num_requests, "free_blocks": blocks.num_free,
                "num_blocks": blocks.num_blocks}  # fmt: skip

    def _deliver(self) -> None:
        for key, seq in list(self._seqs.items()):
            n = len(seq.output_token_ids)
            if n > self._sent[key]:
                if seq.params.logprobs is not None:  # before the tokens they belong to
                    self._emit(key, ("logprobs", seq.output_logprobs[self._sent[key] : n]))
                self._emit(key, ("tokens", seq.output_token_ids[self._sent[key] : n]))
                self._sent[key] = n
            if seq.is_done:
                self._emit(key, ("error", seq.error) if seq.error is not None else ("finished", seq.finish_reason))
                del self._seqs[key], self._sent[key]
                self._sinks.pop(key, None)

    def _forget_done(self) -> None:
        for key, seq in list(self._seqs.items()):
            if seq.is_done:
                del self._seqs[key], self._sent[key]
