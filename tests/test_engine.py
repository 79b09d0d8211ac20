"""Engine on CPU: greedy generation at TP=2 (compiled, SP + async TP) gives the same tokens as TP=1
eager, through chunked prefill, mixed steps and preemption; bad requests are rejected alone."""

import dataclasses
import json
import random

import numpy as np
import pytest
import torch

import tpweave
import workers

ENGINE = dict(
    dtype=torch.float32,
    block_size=4,
    num_blocks=16,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    max_model_len=64,
    compile_model=True,
    sp_min_tokens=0,
)


def _prompts():
    rng = random.Random(0)
    good = [[rng.randrange(1536) for _ in range(n)] for n in (1, 7, 13, 30, 45)]  # none a multiple of TP=2 only
    bad = [[], list(range(100)), [1536]]  # empty, longer than max_model_len=64, outside the vocabulary
    return good, bad


def test_tp2_greedy_tokens_equal_tp1_with_chunking_and_preemption():
    good, bad = _prompts()
    prompts = good[:2] + bad + good[2:]
    ref, _, _ = workers.engine_generate(tpweave.TPContext.single(), prompts, 8, ENGINE)
    results = tpweave.launch(workers.engine_generate, prompts, 8, ENGINE, nprocs=2)
    assert results[0] == results[1]  # both ranks ran the same steps
    got, num_steps, num_compiles = results[0]
    # graphs: M = 1 apart (compiler/dynamic.py), one for every other step's M, batch and block-table shape
    assert 1 <= num_compiles <= 3 and num_steps > 10
    for r, g in zip(ref, got):
        assert g["token_ids"] == r["token_ids"] and g["error"] == r["error"]
    ok = [g for g in got if g["error"] is None]
    assert len(ok) == 5 and all(len(g["token_ids"]) == 8 and g["finish_reason"] == "length" for g in ok)
    assert sum(g["num_preemptions"] for g in ok) > 0  # 16 blocks of 4 cannot hold all five at once
    errors = [g["error"] for g in got if g["error"]]
    assert any("empty prompt" in e for e in errors)
    assert any("does not fit the model's context of 64" in e for e in errors)
    assert any("outside the vocabulary" in e for e in errors)


def test_token_split_graph_in_the_engine_gives_tp1_tokens():
    """The engine at TP=2 with its plain graph run as two token subsets (from M = 4 on; the SP graph never):
    prefill, mixed and decode steps through the paged KV cache give the tokens of TP=1."""
    good, _ = _prompts()
    split = {**ENGINE, "sp_min_tokens": 1 << 20, "token_split_min_tokens": 4}
    ref, _, _ = workers.engine_generate(tpweave.TPContext.single(), good, 8, ENGINE)
    results = tpweave.launch(workers.engine_generate, good, 8, split, 0.0, (), True, nprocs=2)
    assert results[0] == results[1]
    got, _, _, calls = results[0]
    assert calls["split"] > 0 and calls["plain"] > 0 and calls["sp"] == 0, calls  # steps of M >= 4 and M < 4
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in ref]


def test_sampling_is_the_same_on_every_rank():
    good, _ = _prompts()
    results = tpweave.launch(workers.engine_generate, good[:3], 5, ENGINE, 0.8, nprocs=2)
    assert results[0] == results[1]
    assert all(len(r["token_ids"]) == 5 and all(0 <= t < 1536 for t in r["token_ids"]) for r in results[0][0])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_async_scheduling_gives_the_synchronous_engines_tokens(temperature):
    """The asynchronous loop (step N+1 planned and launched before step N's tokens are read) against the
    synchronous one, at TP=1 and TP=2: the same tokens and finish reasons through chunked prefill,
    preemption, and stop tokens that arrive while the sequence's next step is already in flight."""
    good, bad = _prompts()
    prompts = good + bad[:1]
    sync = {**ENGINE, "async_scheduling": False}
    free, _, _ = workers.engine_generate(tpweave.TPContext.single(), prompts, 10, sync, temperature)
    stops = sorted({r["token_ids"][3] for r in free[:3]})  # each of these ends a request early
    ref, sync_steps, _ = workers.engine_generate(tpweave.TPContext.single(), prompts, 10, sync, temperature, stops)
    assert sum(r["finish_reason"] == "stop" for r in ref) >= 3
    got, async_steps, _ = workers.engine_generate(tpweave.TPContext.single(), prompts, 10, ENGINE, temperature, stops)

    def text(results):  # preemptions may differ: blocks are held one step longer under async scheduling
        return [(r["token_ids"], r["finish_reason"], r["error"]) for r in results]

    assert text(got) == text(ref)
    # a token's logprobs stay with it: one per token kept, none for one discarded after a stop in flight
    for r in (r for r in got + ref if r["error"] is None):
        assert len(r["logprobs"]) == len(r["token_ids"]) and all(x.top[0][1] >= x.logprob for x in r["logprobs"])
    # a sequence ended by a stop token in flight was scheduled once more: at least as many steps
    assert async_steps >= sync_steps
    results = tpweave.launch(workers.engine_generate, prompts, 10, ENGINE, temperature, stops, nprocs=2)
    assert results[0] == results[1]
    if temperature == 0.0:  # sampled tokens at TP=2 may differ where logits differ in the last bits
        assert text(results[0][0]) == text(ref)


def test_generate_cli(capsys):
    from tpweave.cli import main

    assert (
        main(
            [
                "generate",
                "--model",
                "tiny",
                "--tp",
                "2",
                "--dtype",
                "float32",
                "--max-tokens",
                "3",
                "--num-prompts",
                "2",
                "--prompt-ids",
                "5,6,7",
                "--prompt-ids",
                "",
                "--no-compile",
                "--logprobs",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "[0] 3 prompt tokens -> [" in out and "(length)" in out
    assert "[1] rejected: empty prompt" in out
    # each generated token of prompt 0 then its logprob and the 2 most likely tokens', every digit of each
    lines = out.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("[0]"))
    tokens = json.loads(lines[head].split("-> ")[1].split(" (")[0])
    scored = [x.split() for x in lines[head + 1 : head + 4]]
    assert [int(x[0].rstrip(":")) for x in scored] == tokens, out
    assert all(float(x[1]) <= 0 and x[2] == "(top:" for x in scored), out


@pytest.mark.gpu(gpus=1)
def test_gpu_llama3_8b_engine_tokens_match_teacher_forced_eager():
    """llama3-8b preset with 8 of its layers (random weights, bf16), 64 greedy tokens from the compiled engine
    (async scheduling, decode in CUDA graphs through the fused decode kernel) at TP=2 where two GPUs exist,
    else TP=1, and from the synchronous engine; every token checked against the eager TP=1 model's
    teacher-forced choice, exact wherever its top-2 margin is clear (bf16 sums in another order can flip a
    near-tie)."""
    from conftest import num_gpus

    tp = min(2, num_gpus())
    rng = random.Random(1)
    prompts = [[rng.randrange(128256) for _ in range(n)] for n in (5, 33, 101, 257)]
    kwargs = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512, sp_min_tokens=64, num_layers=8)
    (got, info), *_ = tpweave.launch(
        workers.gpu_engine_generate, "llama3-8b", prompts, 64, kwargs, nprocs=tp, backend="nccl"
    )
    assert info["num_graphs"] == 3 and info["num_graph_replays"] >= 60  # buckets 1, 2, 4; decode steps replayed
    sync = {**kwargs, "async_scheduling": False}
    ref, _ = tpweave.launch(workers.gpu_engine_generate, "llama3-8b", prompts, 64, sync, nprocs=1, backend="nccl")[0]
    num_equal = sum(a == b for g, r in zip(got, ref) for a, b in zip(g["token_ids"], r["token_ids"]))
    print(f"tokens equal to the synchronous TP=1 engine: {num_equal} / {64 * len(prompts)}")
    if tp == 1:
        assert [g["token_ids"] for g in got] == [r["token_ids"] for r in ref]  # same graphs, same numbers
    _assert_teacher_forced(prompts, got, 64)


def _assert_teacher_forced(prompts, got, num_tokens):
    """Every generated token equals the eager TP=1 model's (llama3-8b, 8 layers) teacher-forced choice wherever its
    top-2 margin is clear (bf16 sums in another order can flip a near-tie)."""
    forced = tpweave.launch(
        workers.gpu_teacher_forced,
        "llama3-8b",
        [(p, g["token_ids"]) for p, g in zip(prompts, got)],
        8,
        nprocs=1,
        backend="nccl",
    )[0]
    for g, (argmax, margins) in zip(got, forced):
        assert len(g["token_ids"]) == num_tokens
        for tok, want, margin in zip(g["token_ids"], argmax, margins):
            assert tok == want or margin < 0.25, (tok, want, margin)


def test_decode_buckets_and_padded_graph_inputs():
    from tpweave.engine.block_manager import slot_of
    from tpweave.engine.buckets import decode_buckets
    from tpweave.engine.config import EngineConfig
    from tpweave.engine.model_runner import ModelRunner
    from tpweave.engine.scheduler import ScheduledChunk
    from tpweave.engine.sequence import Sequence
    from tpweave.engine.staging import StagedInputs

    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_buckets(1) == [1] and decode_buckets(5) == [1, 2, 4, 5] and decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    config = EngineConfig(
        dtype=torch.float32,
        block_size=4,
        num_blocks=8,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=32,
        compile_model=False,
    )
    runner = ModelRunner(tpweave.TPContext.single(), "tiny", config)
    assert runner.model.model.layers[0].self_attn.k_cache.shape[0] == (8 + 1) * 4  # + the pad block
    seqs = [Sequence([1, 2, 3, 4, 5]), Sequence([7, 8])]
    seqs[0].block_table, seqs[1].block_table = [3, 5], [0]
    chunks = [ScheduledChunk(seqs[0], 4, 1), ScheduledChunk(seqs[1], 1, 1)]
    staged = StagedInputs(runner._decode_fields(4), torch.device("cpu"))
    staged.host()["ids"][:] = 99  # left by an earlier step: every row is written again
    runner._write_decode_inputs(chunks, staged.host())
    staged.upload()
    ids, pos, slots, ctx_lens, tables, take = (staged.dev[k] for k in ("ids", "pos", "slots", "ctx_lens", "tables",
                                                                      "take"))  # fmt: skip
    assert ids.tolist() == [5, 8, 0, 0] and pos.tolist() == [4, 1, 0, 0] and ctx_lens.tolist() == [5, 2, 1, 1]
    assert slots.tolist() == [slot_of([3, 5], 4, 4), slot_of([0], 1, 4), 8 * 4, 8 * 4]  # pad rows write the pad block
    assert tables.shape == (4, 8) and tables[0, :2].tolist() == [3, 5] and (tables[2:] == 8).all()
    assert not take.any()
    # a token the previous step sampled, not yet on the host: the graph takes it from that step's samples
    runner._prev_tokens, runner._last_rows = torch.tensor([70, 71, 72, 73]), {seqs[1].seq_id: 2}
    seqs[1].num_pending = 1  # its third token
    runner._write_decode_inputs([chunks[0], ScheduledChunk(seqs[1], 2, 1)], staged.host())
    staged.upload()
    assert take.tolist() == [False, True, False, False] and staged.dev["src"][1] == 2 and ids[1] == 0
    assert runner._take_pending(ids, take, staged.dev["src"]).tolist() == [5, 72, 0, 0]
    # prefill / mixed steps: `fresh` (the last argument, a CPU bool) only when no chunk has cached context
    fresh = runner._inputs([ScheduledChunk(seqs[0], 0, 5), ScheduledChunk(seqs[1], 0, 2)])[-1]
    assert fresh.device.type == "cpu" and bool(fresh)
    for chunks in ([ScheduledChunk(seqs[0], 0, 5), ScheduledChunk(seqs[1], 1, 1)], [ScheduledChunk(seqs[0], 2, 3)]):
        assert not bool(runner._inputs(chunks)[-1])
    # padded up to a piecewise bucket: the padding rows one more sequence, fresh, in the pad block (8)
    chunks = [ScheduledChunk(seqs[0], 2, 3), ScheduledChunk(seqs[1], 0, 2)]
    ids, pos, cu, slots, ctx_lens, tables, bs, rows, fresh = runner._inputs(chunks, pad_to=11, rows_to=4)
    assert ids.tolist() == [3, 4, 5, 7, 8] + [0] * 6 and pos.tolist() == [2, 3, 4, 0, 1, 0, 1, 2, 3, 4, 5]
    assert cu.tolist() == [0, 3, 5, 11] and ctx_lens.tolist() == [5, 2, 6] and not bool(fresh)
    assert tables.shape == (3, 2) and tables[2].tolist() == [8, 8] and tables[0].tolist() == [3, 5]
    assert slots[5:].tolist() == [8 * 4 + p % 4 for p in range(6)]
    assert rows.tolist() == [2, 4, 4, 4]  # each chunk's last row, the last one repeated up to rows_to
    unpadded = runner._inputs(chunks)
    for got, want in zip((ids, pos, slots), (unpadded[0], unpadded[1], unpadded[3])):
        assert got[:5].tolist() == want.tolist()
    # a whole-step graph's inputs: sequences padded with empty ones (no tokens, no context, the pad block), tables
    # to a fixed width; the token rows as above
    ids2, pos2, cu2, slots2, ctx2, tables2, rows2, _, fresh2 = runner._host_inputs(
        chunks, pad_to=11, rows_to=4, seqs_to=6, width_to=8
    )
    assert cu2.tolist() == [0, 3, 5, 11, 11, 11, 11] and ctx2.tolist() == [5, 2, 6, 0, 0, 0] and not fresh2
    assert tables2.shape == (6, 8) and tables2[0].tolist() == [3, 5] + [8] * 6 and (tables2[2:] == 8).all()
    assert ids2.tolist() == ids.tolist() and pos2.tolist() == pos.tolist() and slots2.tolist() == slots.tolist()
    assert rows2.tolist() == rows.tolist()
    with pytest.raises(AssertionError, match="3 sequences padded to 2"):
        runner._host_inputs(chunks, pad_to=11, seqs_to=2)
    # block tables are kept across steps (engine/block_tables.py): one that grew, one freed and allocated anew (a new
    # list of the same length), and a sequence seen for the first time
    seqs[0].block_table.append(6)
    seqs[1].block_table = [2]
    third = Sequence([9])
    third.block_table = [7]
    h = staged.host()
    runner._write_decode_inputs([ScheduledChunk(s, s.num_tokens - 1, 1) for s in (seqs[1], third, seqs[0])], h)
    assert h["tables"][:3, :3].tolist() == [[2, 8, 8], [7, 8, 8], [3, 5, 6]] and (h["tables"][3] == 8).all()


def test_staged_inputs_send_their_fields_in_one_buffer():
    """Fields of any dtype at aligned offsets of one buffer; the host buffers alternate (a step writes one while the
    other may still be on its way); upload(end_of(...)) sends the fields before a field and that field's first rows,
    nothing past them."""
    from tpweave.engine.staging import StagedInputs

    staged = StagedInputs({"ids": ((3,), torch.int64), "take": ((3,), torch.bool), "tables": ((4, 5), torch.int32)},
                          torch.device("cpu"))  # fmt: skip
    assert [t.data_ptr() % 16 for t in staged.dev.values()] == [0, 0, 0]
    first = staged.host()
    first["ids"][:] = [1, 2, 3]
    first["take"][:] = [True, False, True]
    first["tables"][:] = np.arange(20).reshape(4, 5)
    staged.upload(staged.end_of("tables", 2))
    assert staged.dev["ids"].tolist() == [1, 2, 3] and staged.dev["take"].tolist() == [True, False, True]
    assert staged.dev["tables"][:2].flatten().tolist() == list(range(10)) and not staged.dev["tables"][2:].any()
    second = staged.host()
    assert second["ids"] is not first["ids"] and not second["ids"].any()
    second["ids"][:] = 7
    staged.upload()
    assert staged.dev["ids"].tolist() == [7, 7, 7] and not staged.dev["tables"].any()
    assert staged.host()["ids"].tolist() == [1, 2, 3]  # the first buffer again, as the first step left it


def test_empty_sequences_of_a_whole_step_graph_change_no_logit():
    """A mixed step (a decode with cached context, a chunk after cached context, a fresh chunk) padded as a
    whole-step CUDA graph pads it (padding rows, empty sequences, wide block tables) gives each chunk the logits of
    the step padded only to the bucket, bit for bit (CPU: the reference attention; the GPU kernels in
    test_gpu_whole_step_graphs_replay_the_eager_forwards_logits_bitwise)."""
    from tpweave.engine.config import EngineConfig
    from tpweave.engine.model_runner import ModelRunner
    from tpweave.engine.scheduler import ScheduledChunk
    from tpweave.engine.sequence import Sequence

    config = EngineConfig(dtype=torch.float32, block_size=4, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=16,
                          max_model_len=32, compile_model=False)  # fmt: skip
    runner = ModelRunner(tpweave.TPContext.single(), "tiny", config)
    seqs = [Sequence(list(range(1, 10))), Sequence(list(range(20, 27))), Sequence([5, 6, 7])]
    seqs[0].block_table, seqs[1].block_table, seqs[2].block_table = [3, 5, 7], [0, 1], [9]
    chunks = [ScheduledChunk(seqs[0], 8, 1), ScheduledChunk(seqs[1], 4, 3), ScheduledChunk(seqs[2], 0, 3)]
    with torch.no_grad():
        # the cached context: each sequence's earlier tokens written into the page pool first
        runner.forward(*runner._inputs([ScheduledChunk(seqs[0], 0, 8), ScheduledChunk(seqs[1], 0, 4)]))
        want = runner.forward(*runner._inputs(chunks, pad_to=12, rows_to=4))
        *arrays, pending, fresh = runner._host_inputs(chunks, pad_to=12, rows_to=4, seqs_to=7, width_to=9)
        assert pending is None
        ids, pos, cu, slots, ctx_lens, tables, rows = (torch.from_numpy(a) for a in arrays)
        got = runner.forward(ids, pos, cu, slots, ctx_lens, tables, 4, rows, torch.tensor(fresh))
    assert got.shape == want.shape == (4, runner.model.config.vocab_size)
    assert torch.equal(got, want)
    # sequence buckets: x2 apart up to max_num_seqs + 1; a step of T tokens uses those up to the first that holds
    # T + 1 sequences; never T sequences of T tokens (the attention op would take the step for decodes)
    config = dataclasses.replace(config, max_num_seqs=100, max_num_batched_tokens=64)
    runner = ModelRunner(tpweave.TPContext.single(), "tiny", config)
    assert runner._seq_buckets == [9, 17, 33, 65, 101] and not runner.step_graphs  # no graphs on a CPU
    assert runner._step_seq_buckets(8) == [9] and runner._step_seq_buckets(9) == [9, 17]
    assert runner._step_seq_buckets(64) == [9, 17, 33, 65]
    assert runner._step_seqs(9, 9) == 10 and runner._step_seqs(16, 9) == 9


def test_prefill_buckets_pad_a_step_by_at_most_an_eighth_past_256_tokens():
    from tpweave.engine.buckets import bucket_for, prefill_buckets
    from tpweave.engine.config import EngineConfig

    buckets = prefill_buckets(2048)
    assert buckets[:16] == list(range(16, 257, 16)) and buckets[-1] == 2048 and len(buckets) == 16 + 3 * 8
    assert {576, 1024, 1152, 2048} <= set(buckets)  # 64 decodes + a 512-token chunk: no padding
    for m in range(1, 2049):
        b = bucket_for(buckets, m)
        assert b >= m and (b - m < 16 if m <= 256 else (b - m) / m < 1 / 8), (m, b)
    assert bucket_for(buckets, 2049) is None
    assert prefill_buckets(100) == [16, 32, 48, 64, 80, 96, 100] and prefill_buckets(5) == [5]
    assert prefill_buckets(300)[-3:] == [256, 288, 300]
    assert EngineConfig(max_num_batched_tokens=64, prefill_graph_sizes=(64, 8, 8)).prefill_graph_sizes == (8, 64)
    with pytest.raises(ValueError, match=r"prefill_graph_sizes must be integers in \[1, 64\]"):
        EngineConfig(max_num_batched_tokens=64, prefill_graph_sizes=(128,))


@pytest.mark.parametrize("tp", [1, 2])
def test_padded_steps_give_the_unpadded_engines_tokens(tp):
    """Prefill and mixed steps padded up to a bucket (one more sequence of padding rows in the pad block, the
    sampled rows padded too), as the engine does for piecewise CUDA graphs: the same tokens, at TP 1 and 2,
    through chunked prefill and preemption."""
    good, _ = _prompts()
    ref, _, _ = workers.engine_generate(tpweave.TPContext.single(), good, 8, ENGINE)
    if tp == 1:
        got, _, _, stats = workers.engine_generate(tpweave.TPContext.single(), good, 8, ENGINE, pad_to=[16])
    else:
        results = tpweave.launch(workers.engine_generate, good, 8, ENGINE, 0.0, (), False, [16], nprocs=2)
        assert results[0] == results[1]
        got, _, _, stats = results[0]
    assert stats["piecewise"] > 0 and stats["padded_tokens"] > 0 and stats["eager"] == 0, stats
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in ref]


def test_paged_attention_with_rope_inside_equals_rope_then_attention_on_cpu():
    """The paged op's CPU path with cos_sin/positions: RoPE (ops/rope.py) first, then the reference attention."""
    from tpweave.ops import rope

    gen = torch.Generator().manual_seed(0)
    ctx_lens, bs, heads, kv_heads, d = [3, 20], 4, 4, 2, 16  # a fresh prompt of 3 tokens, one decode token
    k_cache, v_cache = (torch.randn(64, kv_heads, d, generator=gen) for _ in range(2))
    tables = torch.tensor([[5, 0, 0, 0, 0], [1, 2, 7, 9, 11]], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 19])
    slots = torch.stack([tables[b, p // bs].long() * bs + p % bs for b, p in zip([0, 0, 0, 1], positions.tolist())])
    q, k, v = (
        torch.randn(4, heads, d, generator=gen),
        torch.randn(4, kv_heads, d, generator=gen),
        torch.randn(4, kv_heads, d),
    )
    cu, ctx = torch.tensor([0, 3, 4], dtype=torch.int32), torch.tensor(ctx_lens, dtype=torch.int32)
    angles = torch.outer(torch.arange(32.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    caches = (k_cache.clone(), v_cache.clone())
    got = torch.ops.tpweave.paged_attention(
        q, k, v, k_cache, v_cache, slots, cu, ctx, tables, bs, 0.25, cos_sin, positions
    )
    q_rot, k_rot = rope.rotate(q, cos_sin, positions), rope.rotate(k, cos_sin, positions)
    want = torch.ops.tpweave.paged_attention(q_rot, k_rot, v, *caches, slots, cu, ctx, tables, bs, 0.25)
    torch.testing.assert_close(got, want)
    assert torch.equal(k_cache[slots], k_rot) and torch.equal(v_cache[slots], v)  # written by rotate_qk's store
    with pytest.raises(ValueError, match="cos_sin and positions go together"):
        torch.ops.tpweave.paged_attention(q, k, v, k_cache, v_cache, slots, cu, ctx, tables, bs, 0.25, cos_sin)


def test_fresh_paged_attention_equals_the_gathering_path_on_cpu():
    """fresh=True (no cached context): attention over the new K/V alone == the paged path over the cache."""
    gen = torch.Generator().manual_seed(1)
    lens, bs, heads, kv_heads, d = [3, 6], 4, 4, 2, 16
    tables = torch.tensor([[5, 0], [1, 2]], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 5])
    owner = [0, 0, 0, 1, 1, 1, 1, 1, 1]
    slots = torch.stack([tables[b, p // bs].long() * bs + p % bs for b, p in zip(owner, positions.tolist())])
    q, k, v = (torch.randn(9, h, d, generator=gen) for h in (heads, kv_heads, kv_heads))
    cu, ctx = torch.tensor([0, 3, 9], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    caches = [torch.zeros(64, kv_heads, d) for _ in range(4)]
    want = torch.ops.tpweave.paged_attention(q, k, v, *caches[:2], slots, cu, ctx, tables, bs, 0.25)
    fresh = torch.tensor(True)
    got = torch.ops.tpweave.paged_attention(q, k, v, *caches[2:], slots, cu, ctx, tables, bs, 0.25, None, None, fresh)
    torch.testing.assert_close(got, want)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])  # the same K/V written


def test_paged_prefill_launch_setting_of_long_rows():
    """The paged kernel's row block for sequences of SHORT_ROWS new tokens or more, from shapes only: 128 where they
    average 1024 new tokens, the fresh kernel's 64 below (short rows have their own launch, GQA packed)."""
    from tpweave.ops import flash_prefill as fp

    assert fp.SHORT_ROWS_TUNING.pack_gqa and fp.SHORT_ROWS_TUNING.block_m == 16
    assert fp.long_rows_tuning(64 + 2000, 65) is fp.DEFAULT_TUNING
    assert fp.long_rows_tuning(16 * 128, 16) is fp.DEFAULT_TUNING
    assert fp.long_rows_tuning(2048, 1) is fp.LONG_ROWS_TUNING


@pytest.mark.gpu(gpus=1)
def test_gpu_piecewise_graphs_replay_the_eager_forwards_logits_bitwise():
    """llama3-8b with 4 of its layers, TP=1: prefill and mixed steps (fresh prompts, chunks with cached context,
    decodes beside a chunk, token counts on and between buckets) replayed from the engine's piecewise CUDA graphs
    give the logits of the same compiled forward run eagerly, bit for bit, on new token ids 10 times; after the
    first round no graph is captured again and no piece runs eagerly."""
    kwargs = dict(max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=2048, num_layers=4,
                  whole_step_graphs=False)  # fmt: skip
    steps = [
        [(1000, 0, 1000)],  # a fresh prompt: bucket 1024
        [(1300, 1000, 300)],  # a chunk behind 1000 cached tokens: 300 -> bucket 320
        [(600, 599, 1)] * 8 + [(512, 0, 512)],  # 8 decodes + a 512-token chunk: 520 -> bucket 576
        [(40, 0, 13), (90, 0, 90), (7, 0, 7)],  # 110 -> bucket 112; three sampled rows (rows padded to 4)
    ]
    (equal, first, last, capture), *_ = tpweave.launch(
        workers.gpu_piecewise_steps, "llama3-8b", kwargs, steps, 10, nprocs=1, backend="nccl"
    )
    assert equal == {i: 10 for i in range(len(steps))}, equal
    assert last["captures"] == first["captures"] and last["eager_misses"] == 0, (first, last)
    assert last["replays"] > first["replays"] > 0
    print("capture:", capture, "pieces:", last)


@pytest.mark.gpu(gpus=1)
def test_gpu_whole_step_graphs_replay_the_eager_forwards_logits_bitwise():
    """llama3-8b with 4 of its layers, TP=1: prefill and mixed steps (fresh prompts, a chunk after cached context,
    decodes beside a chunk) replayed from the engine's graphs of whole steps give the logits of the same compiled
    forward run eagerly on the same padded inputs, bit for bit, on new token ids 10 times; each token count, sequence
    count and kind (fresh or not) replays its own graph; no replay compiles; the captures took less memory than
    their logits would if each graph kept its own."""
    kwargs = dict(max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=2048, num_layers=4)
    steps = [
        [(1000, 0, 1000)],  # a fresh prompt: bucket 1024
        [(1300, 1000, 300)],  # a chunk behind 1000 cached tokens: 300 -> bucket 320
        [(600, 599, 1)] * 8 + [(512, 0, 512)],  # 8 decodes + a 512-token chunk: 520 -> bucket 576
        [(40, 0, 13), (90, 0, 90), (7, 0, 7)],  # 110 -> bucket 112
    ]
    equal, keys, captured, compiles, (graph_bytes, logits_bytes) = tpweave.launch(
        workers.gpu_whole_step_steps, "llama3-8b", kwargs, steps, 10, nprocs=1, backend="nccl"
    )[0]
    print("graph memory", graph_bytes, "whole-step logits", logits_bytes)
    assert graph_bytes < logits_bytes, (graph_bytes, logits_bytes)  # no graph keeps its logits' memory
    assert equal == {i: 10 for i in range(len(steps))}, equal
    # sequences with the padding rows' one: 2, 2, 10, 4 -> buckets 9 and 17 (max_num_seqs + 1)
    assert keys == {0: (1024, 9, True), 1: (320, 9, False), 2: (576, 17, False), 3: (112, 9, True)}, keys
    assert captured > 0 and compiles == 0, (captured, compiles)


@pytest.mark.gpu(gpus=1)
@pytest.mark.parametrize("whole", [True, False], ids=["whole-step-graphs", "piecewise"])
def test_gpu_engine_tokens_with_prefill_graphs_match_teacher_forced_eager(whole):
    """The engine with CUDA graphs of prefill and mixed steps (padded to buckets: whole-step graphs, or the pieces
    between attention ops) against the eager TP=1 model's teacher-forced choice, exact wherever its top-2 margin is
    clear; a second round of the same requests captures nothing new; no step runs eagerly."""
    rng = random.Random(2)
    prompts = [[rng.randrange(128256) for _ in range(n)] for n in (5, 33, 101, 257, 700)]
    kwargs = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024, num_layers=8,
                  whole_step_graphs=whole)  # fmt: skip
    rounds = tpweave.launch(workers.gpu_piecewise_generate, "llama3-8b", prompts, 32, kwargs, nprocs=1, backend="nccl")[
        0
    ]
    (got, stats, pieces), (again, stats2, pieces2) = rounds
    assert stats["whole_graph" if whole else "piecewise"] > 0 and stats["eager"] == 0, stats
    assert stats["piecewise" if whole else "whole_graph"] == 0 and stats["decode_graph"] > 0, stats
    assert pieces2["captures"] == pieces["captures"] and pieces2["eager_misses"] == 0, (pieces, pieces2)
    assert [g["token_ids"] for g in again] == [g["token_ids"] for g in got]
    _assert_teacher_forced(prompts, got, 32)
