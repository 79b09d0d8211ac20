"""End-to-end benchmark commands on CPU (gloo, tiny model): latency arms and rows, the serving client
accounting for every request, request files, kernel categories and checks, and the report."""

import json

import pytest

from tpweave.bench.kernels import categorize, check, expected_categories
from tpweave.bench.serve import Request, load_requests, poisson_requests, summarize
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
        (w, a) for w in ("prefill", "decode") for a in ("baseline", "sp_seq", "sp_fused", "auto", "compute_only")
    }
    for r in rows:
        assert r["ms"] > 0 and r["vs_baseline"] > 0
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
                "--output-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    rows = json.loads((tmp_path / "serve-tiny-tp2-float32.json").read_text())["rows"]
    assert [r["arm"] for r in rows] == ["baseline", "auto"]
    for r in rows:
        assert (r["num_requests"], r["num_finished"], r["num_failed"]) == (5, 3, 2)
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
    assert s["num_finished"] == 1 and s["num_failed"] == 1
    assert s["ttft_ms_p50"] == pytest.approx(100) and s["tpot_ms_p50"] == pytest.approx(150)
    assert s["itl_ms_p99"] == pytest.approx(200, rel=0.02) and s["duration_s"] == pytest.approx(0.4)


def test_kernel_categories_and_checks():
    assert categorize("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "nccl_all_reduce"
    assert categorize("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL") == "nccl_reduce_scatter"
    assert categorize("Memcpy PtoP (Device -> Device)") == "symm_mem"
    assert (
        categorize("void (anonymous namespace)::two_shot_all_reduce_kernel<c10::BFloat16, 16, 2, false, false>")
        == "symm_mem"
    )
    assert (
        categorize("c10::symmetric_memory::barrier_kernel(unsigned int**, int, int, int, unsigned long)") == "symm_mem"
    )
    assert categorize("_all_reduce_rms_norm_kernel") == categorize("_all_reduce_rms_norm_ll_kernel") == "tpweave_comm"
    assert "tpweave_comm" in expected_categories("auto", {"triton_ar_norm_ll"}, "plain")
    need = expected_categories("sp_fused", {"symm_mem_fused"}, "sp")
    assert check("sp_fused", {"nccl_all_gather": 2}, need) == [
        "sp_fused: no symm_mem kernels ran (strategies ['symm_mem_fused'] at this M)"
    ]
    assert check("sp_fused", {"symm_mem": 30}, need) == []
    assert check("baseline", {}, expected_categories("baseline", {"sequential"}, "plain"))
    assert check("compute_only", {"nccl_all_reduce": 1}, {}, forbid_comm=True)
