"""Continuous batching with chunked prefill under a token budget, decodes and prefill chunks mixed in
one step, and preemption by recompute when KV blocks run out. Every request ends finished or failed
with its error; none is lost and the loop cannot stall.

Asynchronous scheduling: schedule() counts a step's tokens as computed and its samples as pending
(Sequence.num_pending) when it plans the step, so the next step can be planned before this one's
tokens are read back; postprocess() then appends them and applies the stop conditions. A sequence
whose pending token already ends it by length (max_tokens, max_model_len) is not scheduled again; one
that a pending stop token ends was scheduled once more, and that step's token is discarded.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tpweave.engine.block_manager import BlockManager
from tpweave.engine.sequence import Sequence, SequenceStatus, TokenLogprobs


@dataclass
class ScheduledChunk:
    """The `num_tokens` tokens of `seq` from position `start` on that one step computes; `samples`: the chunk
    reaches the sequence's last token, so a next token is sampled from its last row (default: decided from
    the sequence when the chunk is made)."""

    seq: Sequence
    start: int  # position of the first token computed in this step
    num_tokens: int
    samples: bool = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.samples is None:
            self.samples = self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """One step's plan: the chunks to compute, the sequences preempted to make room, those that failed."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed in the step, over all chunks (M of the forward)."""
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Decides each step which tokens of which sequences run (module docstring), within max_num_seqs running
    sequences and max_num_batched_tokens tokens per step, and holds their KV blocks in `block_manager`."""

    def __init__(
        self, *, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.blocks = block_manager
        self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len = (
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
        )
        self.waiting: deque[Sequence] = deque()
        self._next_seq_id = 0  # ids are per scheduler (they seed sampling): two engines number alike
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue a request, or raise ValueError naming what is wrong with it (nothing is queued then)."""
        n = len(seq.prompt_token_ids)
        if n == 0:
            raise ValueError("empty prompt: a request needs at least one token")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt of {n} tokens does not fit the model's context of {self.max_model_len} (room for one new "
                "token is needed)"
            )
        seq.params.validate()
        if self.blocks.blocks_for(n + 1) > self.blocks.num_blocks:
            raise ValueError(
                f"prompt of {n} tokens needs more KV blocks than the cache holds ({self.blocks.num_blocks} x "
                f"{self.blocks.block_size})"
            )
        if seq.seq_id < 0:
            seq.seq_id = self._next_seq_id
        self._next_seq_id = max(self._next_seq_id, seq.seq_id) + 1
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether any sequence is still waiting or running."""
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.blocks.free(seq)
        seq.num_computed_tokens = 0  # recompute: its KV is rebuilt from the tokens it has
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step: running sequences first (a prefill chunk or a decode each, preempting the newest
        to free KV blocks), then waiting ones in arrival order while the token budget lasts. A sequence
        that cannot fit even with the whole cache fails and is listed in `failed`."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        # Running sequences first, oldest first: decodes and the next chunks of their prefills.
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:  # preempted or failed in this loop
                continue
            if self._ends_by_length(seq) or seq.num_uncomputed_tokens == 0:
                continue  # its pending token ends it (postprocess finishes it)
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                if len(self.running) == 1:
                    # It holds the whole cache and still needs more: it can never finish.
                    self.running.remove(seq)
                    self._fail(seq, f"needs more KV blocks than the cache holds ({seq.num_tokens} tokens)")
                    out.failed.append(seq)
                    break
                victims = [s for s in self.running if s.seq_id not in scheduled and s is not seq]
                victim = victims[-1] if victims else seq  # the newest one gives its blocks back
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self._plan(seq, n, out)
            scheduled.add(seq.seq_id)
            budget -= n
        # Then new (or preempted) requests, first come first served, chunked to the budget.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._ends_by_length(seq):
                break  # preempted with a pending token that ends it: postprocess finishes it
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._plan(seq, n, out)
            scheduled.add(seq.seq_id)
            budget -= n
        if not out.chunks and self.waiting and not self.running and not self.waiting[0].num_pending:
            # Alone with the whole cache and still no room: this request can never run.
            seq = self.waiting.popleft()
            self._fail(seq, f"needs more KV blocks than the cache holds ({seq.num_tokens} tokens)")
            out.failed.append(seq)
        return out

    def _plan(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        """Put the next n tokens of seq in the step: KV slots, the chunk, and (planned ahead of the results)
        the tokens counted as computed and the sample as pending."""
        self.blocks.grow(seq, seq.num_computed_tokens + n)
        chunk = ScheduledChunk(seq, seq.num_computed_tokens, n)
        out.chunks.append(chunk)
        seq.num_computed_tokens += n
        seq.num_pending += chunk.samples

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether the tokens generated so far, pending ones included, already end seq by length."""
        return seq.num_pending > 0 and (
            seq.num_generated >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len
        )

    def abort(self, seq: Sequence) -> None:
        """End a waiting or running request now (its client left): its KV blocks freed, finish_reason "abort". A token
        of it still in flight is dropped when its step is read back (postprocess skips ended sequences)."""
        if seq.is_done:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"

    def _fail(self, seq: Sequence, error: str) -> None:
        self.blocks.free(seq)
        seq.status, seq.error = SequenceStatus.FAILED, error

    def postprocess(self, out: SchedulerOutput, next_tokens: dict[int, int],
                    logprobs: dict[int, TokenLogprobs] | None = None) -> list[Sequence]:  # fmt: skip
        """Read back a step's results: append the token sampled for each sequence of `out` that is still
        running (the token of one that ended meanwhile is discarded) and its logprobs where it asked, apply the
        stop conditions, and return the sequences that finished."""
        finished = []
        for chunk in out.chunks:
            seq = chunk.seq
            if not chunk.samples:
                continue
            seq.num_pending -= 1
            if seq.is_done:
                continue
            token = next_tokens[seq.seq_id]
            seq.output_token_ids.append(token)
            if logprobs and seq.seq_id in logprobs:
                seq.output_logprobs.append(logprobs[seq.seq_id])
            reason = None
            if token in seq.params.stop_token_ids:
                reason = "stop"
            elif len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_known_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
                self.blocks.free(seq)
                finished.append(seq)
        if finished:  # one pass over the running list, not one removal per finished sequence
            self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
            if any(s.is_done for s in self.waiting):  # preempted while its last token was in flight
                self.waiting = deque(s for s in self.waiting if not s.is_done)
        return finished
