"""End-to-end benchmark commands on CPU (gloo, tiny model): latency arms and rows, the serving client
accounting for every request, request files, kernel categories and checks, and the report."""

import json

import numpy as np
import pytest
import torch

from tpweave.bench.kernels import Proof, categorize, expected_comm, prove
from tpweave.bench.serve import Request, load_requests, poisson_requests, summarize
from tpweave.bench.stats import aa_check, paired_ratio
from tpweave.bench.timing import time_arms
from tpweave.cli import main


def test_latency_cli_rows_and_report(tmp_path, capsys):
    assert (
        main(
            [
                "bench",
                "latency",
                "--model",
                "tiny",
                "-tp",
                "2",
                "--dtype",
                "float32",
                "--prefill",
                "2x37",
                "--decode",
                "3x20",
                "--num-iters",
                "2",
                "--num-iters-warmup",
                "1",
                "--inner",
                "1",
                "--output-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    data = json.loads((tmp_path / "latency-tiny-tp2-float32.json").read_text())
    rows = data["rows"]
    assert {(r["what"], r["arm"]) for r in rows} == {
        (w, a)
        for w in ("prefill", "decode")
        for a in ("plain_nccl", "plain_best", "sp_seq", "sp_fused", "token_split", "auto", "auto_aa", "compute_only")
    }
    for r in rows:
        assert r["ms"] > 0 and r["vs_plain_best"]["ratio"] > 0 and len(r["samples_ms"]) == 2
        assert r["tokens"] == (74 if r["what"] == "prefill" else 3)
    assert data["meta"]["kind"] == "latency" and data["meta"]["layers"] == 2
    assert (tmp_path / "latency-tiny-tp2-float32-prefill.png").exists()
    assert main(["report", str(tmp_path / "latency-tiny-tp2-float32.json"), "--output-dir", str(tmp_path)]) == 0
    report = (tmp_path / "REPORT.md").read_text()
    assert "## Prefill (time to first token)" in report and "## Decode (time per output token)" in report


def test_serve_cli_accounts_for_every_request(tmp_path, capsys):
    requests = tmp_path / "requests.csv"
    requests.write_text("input_len,output_len\n20,5\n7,9\n0,3\n300,2\n33,4\n")  # one empty, one too long
    assert (
        main(
            [
                "bench",
                "serve",
                "--model",
                "tiny",
                "-tp",
                "2",
                "--dtype",
                "float32",
                "--dataset-path",
                str(requests),
                "--request-rate",
                "50",
                "--max-num-seqs",
                "4",
                "--max-num-batched-tokens",
                "32",
                "--max-model-len",
                "128",
                "--block-size",
                "4",
                "--rounds",
                "2",
                "--output-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    data = json.loads((tmp_path / "serve-tiny-tp2-float32.json").read_text())
    rows = data["rows"]
    assert [r["arm"] for r in rows] == ["baseline", "auto"]
    assert len(data["meta"]["orders"]) == 2 and all(
        sorted(o[1:]) == ["auto", "baseline"] for o in data["meta"]["orders"]
    )
    for r in rows:
        assert r["rounds"] == 2 and len(r["output_token_throughput_rounds"]) == 2
        assert (r["num_requests"], r["num_finished"], r["num_failed"], r["num_lost"]) == (10, 6, 4, 0)
        assert any("empty prompt" in e for e in r["errors"]) and any("does not fit" in e for e in r["errors"])
        assert r["ttft_ms_p50"] > 0 and r["tpot_ms_p99"] >= r["tpot_ms_p50"] > 0 and r["output_token_throughput"] > 0


def test_request_sources(tmp_path):
    reqs = poisson_requests(num_requests=200, rate=10.0, lengths=((5, 9), (1, 3)), seed=0)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
    assert all(g >= 0 for g in gaps) and 0.07 < sum(gaps) / len(gaps) < 0.13  # mean 1 / rate
    assert all(5 <= r.input_len <= 9 and 1 <= r.output_len <= 3 for r in reqs)
    path = tmp_path / "r.json"
    path.write_text(
        json.dumps(
            [{"input_len": 4, "output_len": 2, "arrival_s": 1.5}, {"input_len": 3, "output_len": 1, "arrival_s": 0.5}]
        )
    )
    assert load_requests(path, rate=1.0, seed=0) == [Request(0.5, 3, 1), Request(1.5, 4, 2)]
    path.write_text(json.dumps([{"input_len": 4}]))
    with pytest.raises(ValueError, match="request 0 needs integer input_len and output_len"):
        load_requests(path, rate=1.0, seed=0)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read requests"):
        load_requests(path, rate=1.0, seed=0)


def test_summary_percentiles():
    recs = [
        {"arrival_s": 0.0, "input_len": 4, "output_len": 3, "token_times": [0.1, 0.2, 0.4], "error": None},
        {"arrival_s": 0.1, "input_len": 4, "output_len": 1, "token_times": [], "error": "rejected"},
    ]
    s = summarize(recs)
    assert s["num_finished"] == 1 and s["num_failed"] == 1 and s["num_lost"] == 0
    assert s["ttft_ms_p50_ci"] == [pytest.approx(100), pytest.approx(100)]
    assert s["ttft_ms_p50"] == pytest.approx(100) and s["tpot_ms_p50"] == pytest.approx(150)
    assert s["itl_ms_p99"] == pytest.approx(200, rel=0.02) and s["duration_s"] == pytest.approx(0.4)


class _LosingEngine:
    """A fake engine whose scheduler silently drops the second request: it never finishes nor fails."""

    vocab_size = 100

    def __init__(self):
        from tpweave.engine import Sequence

        self.Sequence, self.seqs, self.scheduler = Sequence, [], self

    def add_request(self, prompt, params):
        seq = self.Sequence(prompt, params)
        self.seqs.append(seq)
        return seq

    def has_unfinished(self):  # the engine's and its scheduler's
        return any(s.finish_reason is None for i, s in enumerate(self.seqs) if i != 1)

    def step(self):
        for i, seq in enumerate(self.seqs):
            if i != 1 and seq.finish_reason is None:
                seq.output_token_ids.append(1)
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    seq.finish_reason = "length"


def test_a_planted_lost_request_is_counted_as_lost():
    """Lost = sent, then neither finished nor failed: counted on its own, never as records minus finished."""
    import tpweave
    from tpweave.bench.serve import run_requests

    requests = [Request(0.0, 3, 2), Request(0.0, 4, 2), Request(0.0, 5, 1)]
    records = run_requests(tpweave.TPContext.single(), _LosingEngine(), requests, seed=0)
    s = summarize(records, num_sent=4)  # and one request that never even got a record
    assert (s["num_requests"], s["num_finished"], s["num_failed"], s["num_lost"]) == (4, 2, 0, 2)
    assert [r.get("lost", False) for r in records] == [False, True, False]


def test_workloads_follow_their_published_statistics():
    from tpweave.bench.serve import WORKLOADS

    reqs = poisson_requests(num_requests=4000, rate=float("inf"), lengths=WORKLOADS["azure-code"], seed=1)
    inputs, outputs = sorted(r.input_len for r in reqs), sorted(r.output_len for r in reqs)
    assert 1350 < inputs[2000] < 1650 and 11 <= outputs[2000] <= 15  # medians 1500 and 13
    assert all(r.arrival_s == 0.0 for r in reqs)
    share = poisson_requests(num_requests=4000, rate=10.0, lengths=WORKLOADS["sharegpt"], seed=1, max_total=1024)
    assert 140 < sum(r.input_len for r in share) / 4000 < 175  # mean 161 (clipped a little)
    assert all(r.input_len + r.output_len <= 1023 for r in share)


def test_kernel_categories_and_checks():
    assert categorize("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "nccl_all_reduce"
    assert categorize("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL") == "nccl_reduce_scatter"
    assert categorize("Memcpy PtoP (Device -> Device)") == "peer_copy"
    two_shot = "void (anonymous namespace)::two_shot_all_reduce_kernel<c10::BFloat16, 16, 2, false, false>"
    assert categorize(two_shot) == "symm_mem_two_shot"
    assert (
        categorize("c10d::symmetric_memory::barrier_kernel(unsigned int**, int, int, int, unsigned long)")
        == "symm_mem_signal"
    )
    assert categorize("_all_reduce_rms_norm_kernel") == "tpweave_ar_norm"
    assert categorize("_all_reduce_rms_norm_ll_kernel") == "tpweave_ar_norm_ll"
    # bench engine's kernel time by kind: tpweave's decode kernels and flash attention (cutlass-based) are
    # attention, cuBLAS kernels (split-K reductions too) and tpweave's GEMV gemm
    assert categorize("_decode_kernel") == categorize("_merge_kernel") == "attention"
    assert categorize("void pytorch_flash::flash_fwd_kernel<cutlass::bfloat16_t>") == "attention"
    assert categorize("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT") == "gemm"
    assert categorize("_gemv_kernel") == categorize("void cublasLt::splitKreduce_kernel<32, 16, int>") == "gemm"


def _counts(expected):
    return {k: (e.count, e.exact) for k, e in expected.items()}


def test_kernel_proof_counts_every_site_at_every_m():
    """The proof on recorded kernel lists: each strategy's kernels equal the sites that chose it at this
    M; categories nothing chose must not appear (compute-only: no communication at all)."""
    graph = {  # two layers of a plain graph: 2 fused all-reduce + norms, 2 routed all-reduces, the LM head's gather
        "counts_after": {"all_reduce_rms_norm": 2, "all_reduce_routed": 2, "all_gather_into_tensor": 1},
        "dispatched": [["all_reduce_rms_norm", "triton_ar_norm@0,sequential@1024"]] * 2
        + [["all_reduce", "symm_mem_one_shot@0,sequential@512"]] * 2,
    }
    small = expected_comm(graph, 64)
    assert _counts(small) == {
        "tpweave_ar_norm": (2, True),
        "symm_mem_one_shot": (2, True),
        "nccl_all_gather": (1, True),
    }
    big = expected_comm(graph, 2048)
    assert _counts(big) == {"nccl_all_reduce": (4, True), "nccl_all_gather": (1, True)}
    seen = {"tpweave_ar_norm": 2, "symm_mem_one_shot": 2, "nccl_all_gather": 1, "gemm": 14}
    assert prove("auto", seen, small) == Proof("proved")
    assert prove("auto", {**seen, "symm_mem_one_shot": 1}, small).problems == (
        "auto: 1 symm_mem_one_shot kernels per call, expected 2 (sites: all_reduce -> symm_mem_one_shot)",
    )
    # one rank: NCCL and the two-shot path launch nothing; torch's one-shot kernel and tpweave's still run
    alone = expected_comm(graph, 64, world_size=1)
    assert _counts(alone) == {"tpweave_ar_norm": (2, True), "symm_mem_one_shot": (2, True)}
    # a strategy that cannot run here counts as sequential, which runs in its place
    fallback = expected_comm(graph, 64, available=lambda name: name == "sequential")
    assert _counts(fallback) == {"nccl_all_reduce": (4, True), "nccl_all_gather": (1, True)}
    # SP graph: torch's fused ops (their barriers and a peer copy per peer, at least), an inserted gather left alone
    dispatched = [["ag_mm", "symm_mem_fused"]] * 2 + [["mm_rs", "sequential"]] * 2
    sp = {"counts_after": {"ag_mm": 2, "mm_rs": 2, "all_gather_tokens": 1}, "dispatched": dispatched}
    need = expected_comm(sp, 4096)
    assert _counts(need) == {"symm_mem_signal": (4, False), "peer_copy": (2, False), "nccl_reduce_scatter": (2, True),
                             "nccl_all_gather": (1, True)}  # fmt: skip
    assert prove("sp_fused", {"symm_mem_signal": 14, "peer_copy": 2, "nccl_reduce_scatter": 2, "nccl_all_gather": 1},
                 need) == Proof("proved")  # fmt: skip
    assert prove("sp_fused", {"nccl_reduce_scatter": 2, "nccl_all_gather": 1}, need).problems == (
        "sp_fused: 0 symm_mem_signal kernels per call, expected at least 4 (sites: ag_mm -> symm_mem_fused; a site "
        "that fell back launches none)",
        "sp_fused: 0 peer_copy kernels per call, expected at least 2 (sites: ag_mm -> symm_mem_fused; a site "
        "that fell back launches none)",
    )
    # compute-only: nothing expected, every communication kernel is a problem; plain arms: no reduce-scatter
    assert prove("compute_only", {"nccl_all_reduce": 1}, {}).problems == (
        "compute_only: 1 nccl_all_reduce kernels per call, expected 0 (no site chose this category)",
    )
    plain = expected_comm({"counts_after": {"all_reduce": 4}, "dispatched": []}, 8)
    assert prove("plain_nccl", {"nccl_all_reduce": 4, "nccl_reduce_scatter": 4}, plain).status == "failed"


def test_kernel_proof_cannot_pass_empty_and_catches_a_planted_fallback():
    """Recorded kernel lists of one H200 (TP=1, 2 layers, benchmarks/results/2026-12-02/layer-*-tp1-*.json): an arm
    that expects nothing (plain NCCL at one rank) is "n/a", never "proved"; torch's fused ops at one rank are proved
    by their barrier kernels, and a site planted as fallen back to `sequential` (which launches nothing at one rank)
    leaves too few of them: the proof fails."""
    barrier = "c10d::symmetric_memory::barrier_kernel(unsigned int**, int, int, int, unsigned long)"
    plain = {"counts_after": {"all_reduce": 4}, "dispatched": []}
    assert prove("plain_nccl", {}, expected_comm(plain, 128, world_size=1)) == Proof("n/a")
    sp = {"counts_after": {"all_gather_tokens": 1}, "dispatched": [["ag_mm", "symm_mem_fused"]] * 4
          + [["mm_rs", "symm_mem_fused"]] * 4}  # fmt: skip
    recorded = {categorize(barrier): 17.0}  # sp_fused at M = 128, 512, 2048 in that run
    assert prove("sp_fused", recorded, expected_comm(sp, 128, world_size=1)) == Proof("proved")
    planted = {**sp, "dispatched": sp["dispatched"][:-1] + [["mm_rs", "sequential"]]}  # the last site fell back
    one_site_fewer = {categorize(barrier): 15.0}  # the trace then: 2 barrier kernels fewer
    assert prove("sp_fused", one_site_fewer, expected_comm(sp, 128, world_size=1)).status == "failed"
    # the planted graph's own expectation is what the trace shows
    assert prove("sp_fused", one_site_fewer, expected_comm(planted, 128, world_size=1)).status == "proved"


def test_results_say_n_a_where_nothing_was_profiled_or_expected():
    from tpweave.bench.results import proof_text

    assert proof_text({"verification_problems": [], "kernels": {"128": {}}}) == (
        "n/a (nothing profiled: no GPU kernels to count)"
    )
    kernels = {"128": {"plain_nccl": {"proof": "n/a"}, "auto": {"proof": "proved"}},
               "512": {"plain_nccl": {"proof": "n/a"}, "auto": {"proof": "proved"}}}  # fmt: skip
    assert proof_text({"verification_problems": [], "kernels": kernels}) == (
        "passed for auto at every shape; n/a for plain_nccl (no kernel expected: certifies nothing)"
    )
    assert proof_text({"verification_problems": ["M=128 auto: ..."], "kernels": kernels}).startswith("FAILED")


def test_paired_intervals_and_the_aa_flag():
    rng = np.random.default_rng(0)
    noise = rng.normal(1.0, 0.01, 200)
    same = paired_ratio(list(10 * noise), list(10 * noise[::-1]))
    assert same.lo < 1.0 < same.hi and same.verdict == "no significant difference" and "no significant" in same.text()
    faster = paired_ratio(list(10 * noise), list(9 * noise))
    assert faster.lo > 1.05 and faster.verdict == "faster" and faster.text().startswith("1.11")
    # pairing: a drift shared by both arms (same repetition) does not widen the interval
    drift = np.linspace(1.0, 1.5, 200)
    paired = paired_ratio(list(10 * drift * noise), list(9.9 * drift * noise))
    assert paired.significant and paired.hi - paired.lo < 0.01
    assert aa_check([1.0] * 10, [1.0] * 10)["flagged"] is False
    biased = aa_check(list(10 * noise), list(10.3 * noise))
    assert biased["flagged"] is True and biased["half_width"] < 0.01
    tiny = paired_ratio([1.0, 2.0], [1.0, 2.0])
    assert not tiny.significant  # two samples make no interval
    with pytest.raises(ValueError, match="equal non-empty lengths"):
        paired_ratio([1.0], [1.0, 2.0])


def test_the_aa_control_is_the_yardstick_of_small_significant_ratios():
    """A ratio whose interval excludes 1.0 but which lies within the A/A half-width is not a loss (nor a win): its
    verdict and table text say so; a loss larger than the A/A spread stays "slower"."""
    from tpweave.bench.arms import arm_rows
    from tpweave.bench.results import _fmt
    from tpweave.bench.stats import AA_NOISE
    from tpweave.bench.timing import ArmTiming

    rng = np.random.default_rng(0)
    base = 1.0 + rng.normal(0, 1e-4, 60)
    timings = {
        "plain_nccl": ArmTiming(list(base)),
        "auto": ArmTiming(list(base * 1.001 + rng.normal(0, 1e-5, 60))),  # 0.1% slower, tightly
        "auto_aa": ArmTiming(list(base * (1 + rng.normal(0, 4e-3, 60)))),  # two captures differ by ~0.4%
        "sp_seq": ArmTiming(list(base * 1.03)),  # 3% slower
    }
    rows = {r["arm"]: r for r in arm_rows(timings, key={"tokens": 1})}
    auto, sp = rows["auto"]["vs_plain_best"], rows["sp_seq"]["vs_plain_best"]
    assert auto["hi"] < 1.0 and auto["verdict"] == AA_NOISE and _fmt(auto).endswith("n.s. (A/A)")
    assert abs(auto["ratio"] - 1) <= rows["auto"]["aa"]["half_width"]
    assert sp["verdict"] == "slower" and not _fmt(sp).endswith("n.s.")
    del timings["auto_aa"]  # without the control nothing is reclassified
    rows = {r["arm"]: r for r in arm_rows(timings, key={"tokens": 1})}
    assert rows["auto"]["vs_plain_best"]["verdict"] == "slower"


def test_timing_shuffles_arms_per_repetition_with_a_recorded_seed():
    calls = []
    arms = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
    timings = time_arms(arms, reps=12, warmup=0, inner=1, seed=7)
    again = time_arms(arms, reps=12, warmup=0, inner=1, seed=7)
    assert timings.orders == again.orders and timings.seed == 7
    assert len({tuple(o) for o in timings.orders}) > 3 and all(sorted(o) == list("abcd") for o in timings.orders)
    assert all(len(t.samples_ms) == 12 for t in timings.values()) and set(timings.runners) == set("abcd")


def test_engine_rooflines_count_what_the_model_computes_and_reads():
    """bench engine's prefill FLOPs: the matmuls torch's flop counter sees in the forward (LM head on the last
    row), plus causal attention; weight bytes: every parameter but the embedding table (untied)."""
    from torch.utils.flop_counter import FlopCounterMode

    import tpweave
    from tpweave.bench.engine import kv_bytes, model_bytes, prefill_flops
    from tpweave.models import build_model

    model = build_model("tiny", tp=tpweave.TPContext.single(), dtype=torch.float32)
    m = 64
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(100, (m,)), torch.arange(m), torch.tensor([0, m], dtype=torch.int32),
              logits_rows=torch.tensor([m - 1]))  # fmt: skip
    attn = model.model.layers[0].self_attn
    causal = 2 * 2 * (m * (m + 1) / 2) * attn.num_heads * attn.head_dim * len(model.model.layers)
    assert prefill_flops(model, m) == counter.get_total_flops() + causal
    embed = model.model.embed_tokens.weight
    assert model_bytes(model) == sum(p.numel() * 4 for p in model.parameters()) - embed.numel() * 4
    model.set_kv_cache(64)
    per_token = 2 * attn.num_kv_heads * attn.head_dim * 4 * len(model.model.layers)
    assert kv_bytes(model, [10, 30]) == 40 * per_token


def test_engine_results_render_with_their_plot(tmp_path):
    from tpweave.bench.results import load_results, summary, write_results

    rows = [
        {"what": "engine_decode", "batch": b, "context": 1024, "step_ms": 6.0 + b / 64, "forward_ms": 5.5 + b / 64,
         "step_over_forward": 1.08, "roofline_ms": 3.2, "of_roofline": 0.58, "kernels_per_step": 330.0,
         "kernels_per_forward": 327.0, "copies_per_step": 2.0, "graph_bucket": b}
        for b in (1, 64)
    ]  # fmt: skip
    rows.append({"what": "engine_prefill", "tokens": 2048, "padded_to": 2048, "path": "whole-step graph",
                 "forward_ms": 45.0, "roofline_ms": 40.0,
                 "of_roofline": 0.9, "of_datasheet_peak": 0.61, "single_over_graph": 1.01})  # fmt: skip
    rows.append({"what": "engine_mixed", "decodes": 64, "context": 1024, "chunk": 512, "tokens": 576, "padded_to": 576,
                 "single_over_graph": 1.03, "peak_bytes_eager": 3e9})  # fmt: skip
    json_path, md_path = write_results(tmp_path, "engine-x", {"kind": "engine", "model": "m"}, rows)
    text = md_path.read_text()
    assert "## Engine decode step" in text and "## Engine prefill vs matmul roofline" in text
    assert "## Engine mixed step (decodes + a prefill chunk) vs its graph-replayed forward" in text
    assert "| 64 | 1024 | 7 |" in text and "| 330 | 327 | 2 | 64 |" in text
    assert "| 2048 | 2048 | whole-step graph | 45 |" in text and "| 0.9 | 0.61 |" in text
    assert "| 64 | 1024 | 512 | 576 | 576 |" in text
    assert load_results(json_path)[1] == rows
    head = summary([("engine-x", {"kind": "engine", "model": "m"}, rows)])
    assert "| prefill | 2048 | 1.01 (one call / graph) | 0.9 (matmul; 0.61 of the datasheet peak) | - |" in head
    assert "| mixed | 64x1024 + 512 | 1.03 (one call / graph) | - | - |" in head


def test_datasheet_figures_match_gpu_names(monkeypatch):
    """The HBM and bf16 peaks come from the entry whose words all appear in the GPU's name; unknown GPUs have
    none (the HBM limit is then measured)."""
    from tpweave.bench import engine

    for name, hbm, flops in [("NVIDIA H200", 4.8e12, 989.4e12), ("NVIDIA H100 80GB HBM3", 3.35e12, 989.4e12),
                             ("NVIDIA H100 PCIe", 2.0e12, 756.5e12)]:  # fmt: skip
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert engine._datasheet(None, engine.HBM_BYTES_PER_S)[0] == hbm
        assert engine._datasheet(None, engine.BF16_DENSE_FLOPS)[0] == flops
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Some GPU")
    assert engine._datasheet(None, engine.BF16_DENSE_FLOPS) is None


def test_progress_bars_stay_out_of_logs():
    """A tqdm bar only on a terminal: in a log file its carriage returns ran into the markdown table after it."""
    from tpweave.log import progress_bar

    assert progress_bar(total=3, desc="requests").disable  # pytest captures stderr: not a terminal
    assert list(progress_bar(items=[1, 2], desc="M")) == [1, 2]


def test_intervals_cover_the_variation_between_captures():
    """Two captures of one graph differ by more than the replays of one (0.25-0.43% on one H200): an A/A pair whose
    copies landed on captures 0.3% apart is flagged by a bootstrap over repetitions alone, and holds 1.0 once the
    bootstrap resamples captures first (repetition i replays capture i % 3)."""
    from tpweave.bench.stats import aa_check

    rng = np.random.default_rng(1)
    groups = [i % 3 for i in range(60)]
    offsets_a, offsets_b = [1.000, 1.003, 0.998], [1.003, 1.000, 1.004]  # each copy's three captures
    a = [10 * offsets_a[g] * (1 + rng.normal(0, 2e-4)) for g in groups]
    b = [10 * offsets_b[g] * (1 + rng.normal(0, 2e-4)) for g in groups]
    assert aa_check(a, b)["flagged"]  # repetitions alone: the captures' offsets look like a real difference
    hierarchical = aa_check(a, b, groups=groups)
    assert not hierarchical["flagged"] and hierarchical["lo"] < 1.0 < hierarchical["hi"], hierarchical
    with pytest.raises(ValueError, match="one capture index per repetition"):
        aa_check(a, b, groups=groups[:-1])


def test_each_arm_is_timed_over_several_captures():
    """On CUDA each arm gets `captures` graphs, repetition i replaying capture i % captures (the groups of its
    samples); on the CPU there is nothing to capture: one runner, one group."""
    from tpweave.bench.timing import time_arms

    calls = {"x": 0}

    def arm():
        calls["x"] += 1

    timings = time_arms({"a": arm, "b": arm}, reps=6, warmup=1, inner=1, captures=3)
    want = [i % timings.captures for i in range(6)]
    assert timings["a"].groups == timings["b"].groups == want and len(timings["a"].samples_ms) == 6
    assert timings.captures == (3 if torch.cuda.is_available() else 1)
    with pytest.raises(ValueError, match="captures must be >= 1"):
        time_arms({"a": arm}, captures=0)


def test_gpu_clocks_sampled_through_the_run(tmp_path, monkeypatch):
    """nvidia-smi's samples through a run summarized per GPU (min / median / max SM clock and power) and said in the
    provenance; where there is no nvidia-smi the summary says it was not sampled."""
    from tpweave.bench import provenance
    from tpweave.bench.results import provenance_lines

    csv = "timestamp, index, clocks.sm [MHz], clocks.mem [MHz], power.draw [W], temperature.gpu\n" + "".join(
        f"2026/12/04 00:00:0{i}.000, 0, {1980 - 100 * i}, 3201, {600 + 20 * i}, 50\n" for i in range(5)
    )

    class FakeSmi:
        def __init__(self, cmd, stdout, stderr):
            assert cmd[0] == "nvidia-smi" and "-lms=500" in cmd
            stdout.write(csv)

        def terminate(self):
            pass

        def wait(self, timeout):
            pass

    monkeypatch.setattr(provenance.subprocess, "Popen", FakeSmi)
    with provenance.GpuSampler(tmp_path / "run-nvidia-smi.csv") as sampler:
        pass
    summary = sampler.summary()
    assert summary == {
        "file": "run-nvidia-smi.csv",
        "samples": 5,
        "per_gpu": {"0": {"sm_clock_mhz": [1580.0, 1780.0, 1980.0], "power_w": [600.0, 640.0, 680.0]}},
    }
    line = provenance_lines({"gpu_samples": summary})[0]
    assert line == ("- GPU 0 through the run (5 samples, run-nvidia-smi.csv): SM clock 1580.0 / 1780.0 / 1980.0 MHz, "
                    "power 600.0 / 640.0 / 680.0 W (min / median / max)")  # fmt: skip

    def missing(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(provenance.subprocess, "Popen", missing)
    with provenance.GpuSampler(tmp_path / "none.csv") as sampler:
        pass
    assert sampler.summary() == {"file": None, "why": "not sampled: No such file or directory"}
    assert not (tmp_path / "none.csv").exists()


def test_a_copy_of_the_tree_proves_its_commit_with_the_manifest(tmp_path, monkeypatch):
    """The GPU machine's copy of the checkout carries git metadata that can lag behind its files (19 of 20 runs were
    recorded dirty, naming commits whose sources they did not run). With the manifest written before the copy, a
    run whose sources hash to the manifest's records the manifest's commit, clean; other sources stay dirty."""
    import json

    from tpweave.bench import provenance

    stale = {"rev-parse": "0" * 40, "status": " M src/tpweave/x.py"}  # what the copy's git says
    monkeypatch.setattr(
        provenance, "_git", lambda *args: stale["status"] if args[0] == "status" else stale["rev-parse"]
    )
    manifest = tmp_path / "manifest.json"
    monkeypatch.setenv("TPWEAVE_MANIFEST", str(manifest))
    manifest.write_text(json.dumps({"commit": "a" * 40, "source_hash": provenance.source_hash()}))
    code = provenance.code_version()
    assert code["commit"] == "a" * 40 and code["dirty"] is False and code["proved_by"] == provenance.MANIFEST_NAME
    assert provenance.describe(code) == f"commit {'a' * 10} (sources checked against .tpweave-manifest.json)"
    manifest.write_text(json.dumps({"commit": "a" * 40, "source_hash": "0123456789abcdef"}))  # other sources
    code = provenance.code_version()
    assert code["commit"] == "0" * 40 and code["dirty"] is True
