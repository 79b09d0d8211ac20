"""Block manager and scheduler without a model: a deterministic fake 'model' picks each next token
from the whole token history, so any schedule (chunks, mixing, preemption) must give the same text."""

import random

import pytest

from tpweave.engine import BlockManager, SamplingParams, Scheduler, Sequence, SequenceStatus
from tpweave.engine.sequence import PENDING

VOCAB = 97


def fake_next_token(tokens):
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) + len(tokens)) % VOCAB


def reference_output(prompt, params):
    tokens, out = list(prompt), []
    while True:
        out.append(fake_next_token(tokens))
        tokens.append(out[-1])
        if out[-1] in params.stop_token_ids or len(out) >= params.max_tokens:
            return out


class Driver:
    """Steps a scheduler with the fake model as LLMEngine does: synchronously (results read back right after
    each step) or asynchronously (the next step planned before this one's tokens are read back; a pending
    token's id comes from the step in flight, as the model runner takes it from the device)."""

    def __init__(self, scheduler, *, asynchronous):
        self.scheduler, self.asynchronous, self.in_flight = scheduler, asynchronous, None
        self.discarded = 0  # samples of sequences that a stop token in flight had already ended

    def busy(self):
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def step(self):
        out = self.scheduler.schedule()
        prev = self.in_flight[1] if self.in_flight else {}
        nxt = {}
        for c in out.chunks:
            # every scheduled token has a KV slot
            assert len(c.seq.block_table) * self.scheduler.blocks.block_size >= c.start + c.num_tokens
            if c.samples:
                history = [prev[c.seq.seq_id] if t == PENDING else t for t in c.seq.tokens(0, c.start + c.num_tokens)]
                nxt[c.seq.seq_id] = fake_next_token(history)
        if not self.asynchronous:
            self.scheduler.postprocess(out, nxt)
            return out
        if self.in_flight:
            self.discarded += sum(c.samples and c.seq.is_done for c in self.in_flight[0].chunks)
            self.scheduler.postprocess(*self.in_flight)
        self.in_flight = (out, nxt) if out.chunks else None
        return out


def run(scheduler, seqs, *, asynchronous=False, max_steps=10_000):
    stats = {"steps": 0, "mixed": 0, "preempted": 0, "max_tokens": 0}
    driver = Driver(scheduler, asynchronous=asynchronous)
    while driver.busy():
        out = driver.step()
        stats["steps"] += 1
        assert stats["steps"] < max_steps, "scheduler stalled"
        assert out.num_tokens <= scheduler.max_num_batched_tokens
        stats["max_tokens"] = max(stats["max_tokens"], out.num_tokens)
        kinds = {c.num_tokens > 1 for c in out.chunks}
        stats["mixed"] += len(kinds) == 2
        stats["preempted"] += len(out.preempted)
    stats["discarded"] = driver.discarded
    return stats


def test_block_manager_alloc_free_refcounts():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = Sequence([1] * 5), Sequence([2] * 3)
    assert bm.extra_blocks_needed(a, 5) == 2
    bm.grow(a, 5)
    bm.grow(b, 3)
    assert bm.num_free == 1 and not bm.can_grow(a, 13) and bm.can_grow(a, 12)
    assert bm.slot(a, 4) == a.block_table[1] * 4
    bm.free(a)
    assert bm.num_free == 3 and a.block_table == [] and bm.ref_counts[b.block_table[0]] == 1
    with pytest.raises(ValueError, match="check can_grow first"):
        bm.grow(b, 100)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_chunked_prefill_mixes_with_decode_and_matches_unbatched(asynchronous):
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(block_manager=bm, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=200)
    rng = random.Random(0)
    seqs = [
        Sequence(
            [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))], SamplingParams(max_tokens=rng.randint(1, 12))
        )
        for _ in range(10)
    ]
    for s in seqs:
        sched.add(s)
    stats = run(sched, seqs, asynchronous=asynchronous)
    assert stats["mixed"] > 0 and stats["max_tokens"] == 16
    for s in seqs:
        assert s.status is SequenceStatus.FINISHED and s.output_token_ids == reference_output(
            s.prompt_token_ids, s.params
        )
    assert bm.num_free == bm.num_blocks


@pytest.mark.parametrize("asynchronous", [False, True])
def test_preemption_by_recompute_loses_nothing(asynchronous):
    bm = BlockManager(num_blocks=12, block_size=4)  # far fewer blocks than the requests want together
    sched = Scheduler(block_manager=bm, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=64)
    rng = random.Random(1)
    seqs = [
        Sequence(
            [rng.randrange(VOCAB) for _ in range(rng.randint(3, 20))],
            SamplingParams(max_tokens=20, stop_token_ids=tuple(range(0, VOCAB, 13))),  # ~8% of tokens stop
        )
        for _ in range(12)
    ]
    for s in seqs:
        sched.add(s)
    stats = run(sched, seqs, asynchronous=asynchronous)
    assert stats["preempted"] > 0 and (stats["discarded"] > 0) == asynchronous  # stop tokens in flight
    for s in seqs:
        assert s.status is SequenceStatus.FINISHED, s.error
        assert s.output_token_ids == reference_output(s.prompt_token_ids, s.params)
    assert bm.num_free == bm.num_blocks and all(r == 0 for r in bm.ref_counts)


def test_bad_requests_are_rejected_without_disturbing_others():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(block_manager=bm, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=16)
    good = Sequence([1, 2, 3], SamplingParams(max_tokens=3))
    sched.add(good)
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add(Sequence([]))
    with pytest.raises(ValueError, match="does not fit the model's context of 16"):
        sched.add(Sequence(list(range(16))))
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        sched.add(Sequence([1], SamplingParams(max_tokens=0)))
    with pytest.raises(ValueError, match="top_p"):
        sched.add(Sequence([1], SamplingParams(top_p=0.0)))
    run(sched, [good])
    assert good.output_token_ids == reference_output([1, 2, 3], good.params) and list(sched.waiting) == []


def test_request_that_outgrows_the_cache_fails_instead_of_stalling():
    bm = BlockManager(num_blocks=2, block_size=4)  # 8 KV slots in all
    sched = Scheduler(block_manager=bm, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64)
    big = Sequence([1] * 6, SamplingParams(max_tokens=10))  # fits at first, outgrows 8 slots later
    small = Sequence([2], SamplingParams(max_tokens=2))
    sched.add(big)
    sched.add(small)
    run(sched, [big, small])
    assert small.status is SequenceStatus.FINISHED
    assert big.status is SequenceStatus.FAILED and "KV blocks" in big.error
    assert bm.num_free == bm.num_blocks


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_random_arrivals_never_lose_or_stall(seed, asynchronous):
    """Requests arriving between steps, tight cache and budget: every request ends finished with the
    reference text or failed with an error, and every KV block comes back."""
    rng = random.Random(seed)
    blocks = BlockManager(num_blocks=rng.randint(6, 24), block_size=rng.choice([1, 2, 4, 8]))
    sched = Scheduler(
        block_manager=blocks,
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(1, 24),
        max_model_len=64,
    )
    pending = [
        Sequence(
            [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))], SamplingParams(max_tokens=rng.randint(1, 12))
        )
        for _ in range(20)
    ]
    added, steps = [], 0
    driver = Driver(sched, asynchronous=asynchronous)
    while pending or driver.busy():
        for _ in range(rng.randint(0, 3)):
            if pending:
                seq = pending.pop()
                try:
                    sched.add(seq)
                    added.append(seq)
                except ValueError:
                    pass
        driver.step()
        steps += 1
        assert steps < 5000, "scheduler stalled"
    assert blocks.num_free == blocks.num_blocks and all(r == 0 for r in blocks.ref_counts)
    for seq in added:
        assert seq.status in (SequenceStatus.FINISHED, SequenceStatus.FAILED)
        if seq.status is SequenceStatus.FINISHED:
            assert seq.output_token_ids == reference_output(seq.prompt_token_ids, seq.params)
        else:
            assert seq.error


def test_abort_frees_blocks_of_waiting_running_and_in_flight_requests():
    """A request aborted while waiting, while running, and with its token in flight (asynchronous scheduling): its
    blocks are free at once, it ends with finish_reason "abort", its in-flight token is dropped, the others finish."""
    sched = Scheduler(block_manager=BlockManager(num_blocks=32, block_size=4), max_num_seqs=2,
                      max_num_batched_tokens=12, max_model_len=64)  # fmt: skip
    seqs = [Sequence([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=6)) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()  # seqs[0] and seqs[1] planned (their tokens pending), seqs[2] waits
    assert seqs[2] in sched.waiting and seqs[0].block_table
    sched.abort(seqs[2])  # waiting
    sched.abort(seqs[0])  # running, its token in flight
    assert seqs[0].block_table == [] and seqs[2] not in sched.waiting and seqs[0] not in sched.running
    assert seqs[0].finish_reason == seqs[2].finish_reason == "abort"
    sched.postprocess(out, {s.seq_id: fake_next_token(s.tokens(0, s.num_tokens - 1)) for s in seqs[:2]})
    assert seqs[0].output_token_ids == [] and len(seqs[1].output_token_ids) == 1
    run(sched, [seqs[1]])
    assert seqs[1].finish_reason == "length" and sched.blocks.num_free == 32
    sched.abort(seqs[1])  # already finished: nothing changes
    assert seqs[1].finish_reason == "length"
