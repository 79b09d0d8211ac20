"""Every symmetric-memory strategy inside every graph mode, on TP ranks emulated as processes sharing one GPU
(tests/emulated_ranks.py): tpweave's own capture of the compiled module per M (as the engine does), Inductor's CUDA
graph trees (cudagraphs=True) and graph partition at attention with trees per piece (piecewise=True).

What emulation runs: tpweave's own kernels (triton_ar_norm, triton_ar_norm_ll, ce_overlap, ce_overlap_2s, the
token-split side-stream all-reduce + norm). What it cannot: torch's symm_mem ops (symm_mem_one_shot,
symm_mem_two_shot, symm_mem_fused), whose allocator refuses two ranks on one device, and NCCL; their graphs'
structure under the graph modes is checked on the CPU (tests/test_compiler.py), their runs on 2 GPUs
(tests/test_compiler.py, tests/test_gpu_ops.py)."""

import pytest

import workers

pytestmark = pytest.mark.gpu(gpus=1)

COUNTS = [1, 3, 64, 129, 1000]
REPLAYS = 10


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("config", list(workers.GRAPH_MODE_CONFIGS))
def test_strategy_in_every_graph_mode_on_emulated_ranks(config, world_size):
    """Logits of the compiled module (one decoder layer, the final norm, a column-parallel head), every M captured
    once and replayed on new data 10 times, within bf16 rounding of the eager module on the CPU; after the warm-up
    no graph is compiled or captured again; the compiled graphs dispatch the configuration's strategies."""
    import emulated_ranks

    out = emulated_ranks.run(world_size, workers.gpu_graph_modes, config, COUNTS, REPLAYS, timeout_s=540)
    options = workers.GRAPH_MODE_CONFIGS[config]
    want = {p for k, p in options.items() if k.endswith("_policy")}
    for rank_out in out:
        for mode in workers.GRAPH_MODES:
            for m in COUNTS:
                assert rank_out[(mode, m)] < 3e-2, (mode, m, rank_out[(mode, m)])
            warm, end = rank_out[(mode, "counts")]
            assert warm == end and warm[1] > 0, (mode, warm, end)  # (compiles, captures): none after the warm-up
            assert want <= set(rank_out[(mode, "dispatched")]), (mode, rank_out[(mode, "dispatched")])
            if config == "token_split":
                assert rank_out[(mode, "schedule")] > 0, mode  # the split graph ran its two subsets
