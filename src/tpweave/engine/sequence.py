"""A request being generated: its tokens, progress through the prompt, and KV blocks.

Under asynchronous scheduling a sequence can have one token in flight ("pending"): sampled by a step
that was launched but whose result the host has not read yet. It counts in num_tokens (the scheduler
plans the next step around it), reads as PENDING in token_at / tokens (the model runner takes it from
the previous step's sampled tokens on the device), and is not in output_token_ids until it arrives.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

PENDING = -1  # the id of a token that is sampled on the device but not read back yet
MAX_LOGPROBS = 20  # the most likely tokens a generated token can report, at most (the OpenAI API's limit)


class SequenceStatus(enum.Enum):
    """Where a sequence is: waiting to be scheduled, running, or done (finished or failed)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(frozen=True)
class SamplingParams:
    """How each next token is picked: greedy at temperature 0, else temperature and top-p sampling seeded
    from `seed` (None: 0), the step and the sequence id. Generation ends after max_tokens new tokens or
    at a token of stop_token_ids."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # None: none; k: each generated token's log-probability and the k most likely tokens' (TokenLogprobs)
    logprobs: int | None = None

    def validate(self) -> None:
        """Raise ValueError if max_tokens < 1, temperature < 0, top_p is outside (0, 1] or logprobs outside
        [0, MAX_LOGPROBS]."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability under the model (log_softmax of its logits in fp32, before temperature
    and top-p: what a policy-gradient update needs), and the `top` most likely tokens' as (id, logprob), most likely
    first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)  # identity: the scheduler's membership tests and removals never compare token lists
class Sequence:
    """A request: its prompt and generated tokens, how many of them have their KV in the cache, its KV
    blocks, and how it ended (finish_reason "stop" or "length", or an error)."""

    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    seq_id: int = field(default=-1, kw_only=True)  # -1: the scheduler assigns one when the sequence is added
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    error: str | None = None
    finish_reason: str | None = None
    num_pending: int = 0  # sampled tokens in flight (0 or 1): after output_token_ids, ids unknown yet
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token if params.logprobs

    def token_at(self, position: int) -> int:
        """The token at `position` of prompt + output (+ pending: PENDING), without concatenating them."""
        n = len(self.prompt_token_ids)
        if position < n:
            return self.prompt_token_ids[position]
        position -= n
        return self.output_token_ids[position] if position < len(self.output_token_ids) else PENDING

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, PENDING at the positions of pending tokens."""
        n, known = len(self.prompt_token_ids), self.num_known_tokens
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        head = self.prompt_token_ids[start:] + self.output_token_ids[max(start - n, 0) : min(stop, known) - n]
        return head + [PENDING] * (stop - max(start, known)) if stop > known else head

    @property
    def token_ids(self) -> list[int]:
        """Prompt then generated tokens (those read back: no pending one)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_known_tokens(self) -> int:
        """Prompt plus generated tokens read back."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens, pending ones included (what the scheduler plans with)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        """Tokens generated so far, pending ones included."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """Still feeding known tokens (the prompt, or everything again after a preemption)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_done(self) -> bool:
        """Whether the sequence finished or failed."""
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.FAILED)
