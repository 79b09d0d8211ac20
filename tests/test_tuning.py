"""Strategy table, calibration and the layer benchmark on CPU (gloo): the same code the GPU box runs."""

import json
import logging

import pytest
import torch

import tpweave
import workers
from tpweave.cli import main as cli_main
from tpweave.models import get_preset
from tpweave.ops.strategies import STRATEGIES, check_policy, parse_policy, resolve, sequential
from tpweave.tuning.policy_fit import (
    NEVER,
    policy_from_op_rows,
    sp_min_from_layer_rows,
    token_split_min_from_layer_rows,
)
from tpweave.tuning.table import StrategyTable, load_table, save_table, site_shapes, table_key, table_path


def test_policy_strings():
    assert parse_policy("sequential") == ((0, "sequential"),)
    assert parse_policy("symm_mem_fused@512, sequential@0") == ((0, "sequential"), (512, "symm_mem_fused"))
    x = torch.empty(0)
    assert resolve("sequential@0,symm_mem_fused@512", 100, x, "ag_mm") is sequential.ag_mm
    # symm_mem_fused needs CUDA: on CPU the op falls back to the sequential strategy
    assert resolve("sequential@0,symm_mem_fused@512", 4096, x, "ag_mm") is sequential.ag_mm
    assert resolve("no_such_strategy@0", 4, x, "mm_rs") is sequential.mm_rs
    for bad in ("", "sequential@zero", "a@1,b@1", "@4", "sequential@-1"):
        with pytest.raises(ValueError, match="policy"):
            parse_policy(bad)
    with pytest.raises(ValueError, match="unknown strategy 'no_such_strategy'"):
        check_policy("sequential@0,no_such_strategy@64")


def test_one_resolve_rule_composes_the_fused_norm_kinds():
    """A strategy without a fused norm implementation serves it as its base op + the add + norm kernel;
    one that serves neither (or cannot run here) falls back to sequential's composition."""
    x = torch.empty(0)
    composed = resolve("symm_mem_one_shot", 4, x, "all_reduce_rms_norm")  # not available on CPU
    assert composed.func.__name__ == "compose_all_reduce_rms_norm" and composed.args == (sequential.all_reduce,)
    assert STRATEGIES["sequential"].implementation("mm_rs_rms_norm").args == (sequential.mm_rs,)
    assert STRATEGIES["triton_ar_norm"].serves("all_reduce_rms_norm")
    assert not STRATEGIES["triton_ar_norm"].serves("all_reduce") and not STRATEGIES["ce_overlap_2s"].serves("mm_rs")
    with pytest.raises(ValueError, match="unknown op kind"):
        STRATEGIES["sequential"].implementation("all_gather")


def test_policy_and_boundary_from_measurements():
    rows = [
        {"tokens": 1, "arm": "sequential", "ms": 1.0},
        {"tokens": 1, "arm": "fast", "ms": 1.5},
        {"tokens": 512, "arm": "sequential", "ms": 2.0},
        {"tokens": 512, "arm": "fast", "ms": 1.99},  # within noise
        {"tokens": 1024, "arm": "sequential", "ms": 4.0},
        {"tokens": 1024, "arm": "fast", "ms": 3.0},
        {"tokens": 4096, "arm": "sequential", "ms": 9.0},
        {"tokens": 4096, "arm": "fast", "ms": 6.0},
        {"tokens": 4096, "arm": "compute_only", "ms": 1.0},
    ]
    assert policy_from_op_rows(rows) == "sequential@0,fast@1024"
    # with intervals: a faster median whose interval holds 1.0 does not win its M
    unsure = {"ratio": 1.33, "lo": 0.9, "hi": 1.8, "verdict": "no significant difference"}
    sure = {"ratio": 1.5, "lo": 1.4, "hi": 1.6, "verdict": "faster"}
    with_ci = [r | {"vs_sequential": unsure if r["tokens"] == 1024 else sure} for r in rows]
    assert policy_from_op_rows(with_ci) == "sequential@0,fast@4096"
    layers = [
        {"tokens": 1, "arm": "plain_best", "ms_per_layer": 1.0},
        {"tokens": 1, "arm": "auto", "ms_per_layer": 1.2},
        {"tokens": 256, "arm": "plain_best", "ms_per_layer": 2.0},
        {"tokens": 256, "arm": "auto", "ms_per_layer": 1.9},
        {"tokens": 512, "arm": "plain_best", "ms_per_layer": 3.0},
        {"tokens": 512, "arm": "auto", "ms_per_layer": 3.1},
        {"tokens": 2048, "arm": "plain_best", "ms_per_layer": 9.0},
        {"tokens": 2048, "arm": "auto", "ms_per_layer": 8.0},
    ]
    assert sp_min_from_layer_rows(layers) == 2048  # 256 wins, but 512 loses again: only from 2048 on
    assert sp_min_from_layer_rows([r | {"ms_per_layer": 5.0} if r["arm"] == "auto" else r for r in layers[:2]]) == NEVER


def test_token_split_range_from_layer_rows_and_the_plan_that_uses_it():
    """Calibration's token-split range: the smallest M below sp_min from which the token_split arm beats
    plain_best significantly at every larger M below sp_min; the table carries it to the plan, which adds
    the split variant (never at TP=1), and an explicit option overrides it."""
    from tpweave.compiler.options import CompileOptions, plan
    from tpweave.compiler.tp_group import TPGroup

    def row(m, ratio, lo):
        return {"tokens": m, "arm": "token_split", "ms_per_layer": 1.0,
                "vs_plain_best": {"ratio": ratio, "lo": lo, "hi": ratio + 0.02}}  # fmt: skip

    rows = [row(64, 1.01, 0.98), row(256, 1.05, 1.02), row(512, 0.99, 0.97), row(1024, 1.06, 1.03),
            row(2048, 1.08, 1.05), row(4096, 1.10, 1.07)]  # fmt: skip
    assert token_split_min_from_layer_rows(rows, sp_min=4096) == 1024  # 512 loses: only from 1024 on
    assert token_split_min_from_layer_rows(rows, sp_min=512) == 256
    assert token_split_min_from_layer_rows(rows, sp_min=64) is None  # nothing below the SP graph
    insignificant = [r | {"vs_plain_best": {"ratio": 1.05, "lo": 0.99, "hi": 1.1}} for r in rows]
    assert token_split_min_from_layer_rows(insignificant, sp_min=NEVER) is None
    key = table_key(get_preset("tiny"), tp=2, dtype=torch.float32)
    table = StrategyTable(key=key, sp_min_tokens=4096, token_split_min_tokens=1024)
    assert StrategyTable.from_json(table.to_json()) == table
    with pytest.raises(ValueError, match="token_split_min_tokens must be an integer >= 4"):
        StrategyTable.from_json(
            table.to_json().replace('"token_split_min_tokens": 1024', '"token_split_min_tokens": 2')
        )
    two, one = TPGroup("g", 0, 2, "nccl"), TPGroup("", 0, 1, "none")
    with_table = plan(CompileOptions(table=table), two, None)
    assert set(with_table.variants) == {"plain", "sp", "split"} and with_table.token_split_min_tokens == 1024
    assert plan(CompileOptions(table=table, token_split_min_tokens=8), two, None).token_split_min_tokens == 8
    # the fused side-stream all-reduce + norm: 8 SMs by default, in every graph mode
    assert with_table.variants["split"].token_split_sms == 8
    assert plan(CompileOptions(table=table, cudagraphs=True), two, None).variants["split"].token_split_sms == 8
    assert "split" not in plan(CompileOptions(table=table), one, None).variants
    assert "split" not in plan(CompileOptions(table=None), two, None).variants


def test_table_cache_roundtrip_corrupt_and_stale(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TPWEAVE_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger="tpweave")
    key = table_key(get_preset("tiny"), tp=2, dtype=torch.float32)
    assert load_table(key) is None and "run `tpweave calibrate`" in caplog.text
    table = StrategyTable(key=key, policies={"ag_mm:384x384": "sequential@0,symm_mem_fused@64"}, sp_min_tokens=32)
    path = save_table(table)
    assert load_table(key) == table
    path.write_text(path.read_text()[:40])  # truncated write
    assert load_table(key) is None and "is corrupt" in caplog.text
    stale = dict(key, torch="1.0.0")
    table_path(key).write_text(StrategyTable(key=stale).to_json())
    assert load_table(key) is None and "is stale" in caplog.text
    for bad_policy, why in (("sequential@zero", "malformed strategy policy"), ("warp_drive@0", "unknown strategy")):
        caplog.clear()
        path.write_text(StrategyTable(key=key, policies={"ag_mm:384x384": bad_policy}).to_json())
        assert load_table(key) is None, bad_policy
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and str(path) in warnings[0].getMessage() and why in warnings[0].getMessage()
    with pytest.raises(ValueError, match="table: site ag_mm:384x384: unknown strategy 'warp_drive'"):
        tpweave.compiler.CompileOptions(table=StrategyTable(key=key, policies={"ag_mm:384x384": "warp_drive@0"}))


def test_site_shapes_of_llama3_8b():
    names = {s.name for s in site_shapes(get_preset("llama3-8b"), 2)}
    assert names == {
        "ag_mm:4096x3072",
        "ag_mm:4096x14336",
        "ag_mm:4096x64128",
        "mm_rs:2048x4096",
        "mm_rs:7168x4096",
        "all_reduce:4096x4096",
        "all_reduce_rms_norm:4096x4096",
    }
    fp8_names = {s.name for s in site_shapes(get_preset("llama3-8b-fp8"), 2)}  # scaled matmuls; the LM head stays bf16
    assert fp8_names == {
        "ag_scaled_mm:4096x3072",
        "ag_scaled_mm:4096x14336",
        "ag_mm:4096x64128",
        "scaled_mm_rs:2048x4096",
        "scaled_mm_rs:7168x4096",
        "all_reduce:4096x4096",
        "all_reduce_rms_norm:4096x4096",
    }


def test_compile_follows_the_table():
    cfg = get_preset("tiny")
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // 2
    ar_policy = "sequential@0,symm_mem_one_shot@1"  # on CPU the op runs it as 'sequential'
    table = StrategyTable(
        key={},
        policies={
            f"ag_mm:{cfg.hidden_size}x{qkv}": "sequential@0,symm_mem_fused@8",
            f"all_reduce:{cfg.hidden_size}x{cfg.hidden_size}": ar_policy,
        },
        sp_min_tokens=8,
    )
    counts = [3, 8, 40]
    out = tpweave.launch(workers.llama_compiled_outputs, "tiny", counts, ("float32",), {"table": table}, nprocs=2)[0]
    graphs = out[("float32", "graphs")]
    assert [g[0] for g in graphs] == ["plain", "sp"]  # M=3 < 8 ran the plain graph, 8 and 40 the SP graph
    assert graphs[0][2] == {"all_reduce_routed": 2 * cfg.num_layers + 1, "all_gather_into_tensor": 1}
    assert all(s[1:] == ("routed", f"tpweave::all_reduce, policy {ar_policy!r}") for s in graphs[0][3])
    fused = [s for s in graphs[1][3] if s[0] == "all_gather+matmul"]
    assert sum("'sequential@0,symm_mem_fused@8'" in s[2] for s in fused) == cfg.num_layers  # the qkv sites
    default = tpweave.compiler.DEFAULT_OVERLAP_POLICY
    assert sum(f"{default!r}" in s[2] for s in fused) == cfg.num_layers + 1  # gate_up and LM head: the default
    for m in counts:
        torch.testing.assert_close(out[("float32", m, "compiled")], out[("float32", m, "eager")], atol=1e-4, rtol=1e-4)


def test_calibrate_then_bench_layer_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TPWEAVE_CACHE_DIR", str(tmp_path / "cache"))
    common = [
        "--model",
        "tiny",
        "-tp",
        "2",
        "--dtype",
        "float32",
        "--num-layers",
        "1",
        "--num-iters",
        "2",
        "--inner",
        "1",
        "--num-iters-warmup",
        "1",
    ]
    assert cli_main(["calibrate", *common, "--num-tokens", "3,32"]) == 0
    table = load_table(table_key(get_preset("tiny"), tp=2, dtype=torch.float32))
    assert table is not None and set(table.policies) == {s.name for s in site_shapes(get_preset("tiny"), 2)}
    assert table.measurements["ops"] and table.measurements["layers"]
    assert table.sp_min_tokens in (3, 32, NEVER)
    assert any(r["arm"] == "token_split" for r in table.measurements["layers"])
    assert table.token_split_min_tokens in (None, 4, 32)  # the grid's 3 rounds up to the split graph's minimum
    assert cli_main(["bench", "layer", *common, "--num-tokens", "5,17", "--output-dir", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "layer-tiny-tp2-float32.json").read_text())
    assert result["meta"]["calibrated"] is True and result["meta"]["tp"] == 2
    layer_rows = [r for r in result["rows"] if r["what"] == "layer"]
    assert {(r["tokens"], r["arm"]) for r in layer_rows} == {
        (m, a)
        for m in (5, 17)
        for a in ("plain_nccl", "plain_best", "sp_seq", "sp_fused", "token_split", "auto", "auto_aa", "compute_only")
    }
    assert all(r["ms_per_layer"] > 0 for r in layer_rows)
    assert {r["site"] for r in result["rows"] if r["what"] == "op"} == {
        s.name for s in site_shapes(get_preset("tiny"), 2)
    }
    md = (tmp_path / "out" / "layer-tiny-tp2-float32.md").read_text()
    assert "## Decoder layer" in md and "compute_only" in md and "## Overlapped ops" in md


def test_bench_layer_compiles_every_arm_at_every_size():
    """Every arm of `bench layer` compiles the same LayerStack code object: 9 arms x (the graph for M >= 2,
    the one for M = 1) exceed Dynamo's recompile limit, past which it runs the later arms eagerly without a
    word. The harness raises the limit while it compiles, and records each arm's compile report."""
    tokens = [1, 16, 33]
    rows, record = tpweave.launch(workers.bench_layers_record, tokens, nprocs=2, timeout_s=900)[0]
    assert record["fallbacks"] == [], record["fallbacks"]
    reports = record["compile_reports"]
    assert set(reports) == {"plain_nccl", "sp_seq", "sp_fused", "token_split", "auto", "auto_aa", "compute_only"}
    for arm, report in reports.items():
        assert report["num_compiles"] >= 2 and not report["recompile_limit_hit_in"], (arm, report["notes"])
    assert sorted(record["orders"]) == tokens and all(len(o) == 2 for o in record["orders"].values())
    orders = [tuple(order) for m in tokens for order in record["orders"][m]]
    assert len(set(orders)) > 1  # shuffled per repetition, not a fixed rotation
    auto = [r for r in rows if r["arm"] == "auto"]
    assert len(auto) == 3 and all({"ratio", "lo", "hi", "flagged"} <= r["aa"].keys() for r in auto)


def test_bench_latency_defaults_leave_out_the_shapes_past_the_models_positions(monkeypatch, capsys):
    """Given shapes past the model's positions are refused (below); the default sweep is cut to the model, saying
    what it left out, before any rank starts."""
    import tpweave.cli.bench as cli_bench

    class Stop(Exception):
        pass

    seen = {}

    def stop(args):
        seen.update(prefill=args.prefill, decode=args.decode)
        raise Stop

    monkeypatch.setattr(cli_bench, "rank_options", stop)
    with pytest.raises(Stop):
        cli_main(["bench", "latency", "--model", "tiny", "--decode", "2x64"])
    assert (1, 4096) in seen["prefill"] and max(n for _, n in seen["prefill"]) == 4096
    assert seen["decode"] == [(2, 64)]
    err = capsys.readouterr().err
    assert "--prefill default: left out 1x8192, 1x16384, 1x32768 (the model has 4096 positions)" in err
    assert "--decode default" not in err


def test_cli_rejects_bad_arguments(capsys):
    assert cli_main(["bench", "layer", "--model", "tiny", "-tp", "5"]) == 2
    assert "TP=5 does not divide" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["bench", "layer", "--num-tokens", "0,4"])
    assert cli_main(["bench", "latency", "--model", "tiny", "--prefill", "1x5000", "--decode", "1x64"]) == 2
    assert "lengths 1x5000 exceed the model's 4096 positions" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["bench", "latency", "--prefill", "2x"])
    assert cli_main(["bench", "serve", "--model", "tiny", "--arms", "fast"]) == 2
    assert "--arms takes some of baseline, auto, auto_aa, prefill_eager, prefill_piecewise" in capsys.readouterr().err


def test_every_strategy_stays_in_every_graph_mode():
    """Inductor's CUDA graph trees and graph partition get the very plan eager runs get: no strategy is
    swapped for 'sequential' (their persistent state lives outside every graph pool: ops/symm_buffers.py)."""
    from tpweave.compiler.options import CompileOptions, plan
    from tpweave.compiler.tp_group import TPGroup

    everything = ",".join(f"{name}@{16 * i}" for i, name in enumerate(STRATEGIES))
    table = StrategyTable(
        key=table_key(get_preset("tiny"), tp=2, dtype=torch.float32),
        sp_min_tokens=64,
        token_split_min_tokens=16,
        policies={"all_reduce:8x8": everything, "ag_mm:4x4": everything},
    )
    two = TPGroup("g", 0, 2, "nccl")
    options = dict(table=table, ag_mm_policy=everything, mm_rs_policy=everything, all_reduce_policy=everything)
    eager = plan(CompileOptions(**options), two, None)
    for modes in ({"cudagraphs": True}, {"cudagraphs": True, "piecewise": True}, {"piecewise": True}):
        graphed = plan(CompileOptions(**options, **modes), two, None)
        assert graphed.variants == eager.variants, modes
        assert graphed.variants["sp"].policy("ag_mm", 4, 4) == everything
        assert graphed.variants["plain"].policy("all_reduce", 8, 8) == everything
        assert graphed.variants["split"].token_split_sms == 8


def test_one_rank_plans_nothing_that_only_pays_off_with_peers():
    """At TP=1 `tpweave.compile`'s defaults are the plain TP baseline's plan: no SP graph, no token split, no fused
    all-reduce + norm kernel (it has nothing to exchange), every policy `sequential`, whatever the backend."""
    from tpweave.bench.layer import _layer_arms
    from tpweave.compiler.options import PLAIN_TP, CompileOptions, plan
    from tpweave.compiler.tp_group import TPGroup
    from tpweave.runtime.context import TPContext

    for backend in ("nccl", "gloo", "none"):
        one = TPGroup("g" if backend != "none" else "", 0, 1, backend)
        auto, baseline = plan(CompileOptions(), one, None), plan(PLAIN_TP, one, None)
        assert auto.variants == baseline.variants and set(auto.variants) == {"plain"}, backend
        assert auto.token_split_min_tokens is None
        opts = auto.variants["plain"]
        assert {opts.all_reduce_policy, opts.all_reduce_rms_norm_policy, opts.ag_mm_policy} == {"sequential"}
    # the layer bench's auto arms are these defaults (it once forced an SP graph at TP=1)
    _, compiled = _layer_arms(TPContext.single(), "tiny", dtype=torch.float32, num_layers=1, table=None,
                              arms=("auto", "auto_aa", "plain_best"))  # fmt: skip
    assert set(compiled["auto"].plan.variants) == set(compiled["auto_aa"].plan.variants) == {"plain"}
    assert compiled["auto"].plan.variants == compiled["plain_nccl"].plan.variants
