#!/usr/bin/env bash
# Issue 38 on one GPU (llama3-8b on one H200: tests about 5 minutes, cost 7, attention 2 or 3, matmul 3 or 4; a device
# call runs 10 at most, so tests and cost go in separate calls): the GPU invariance tests, then
# the cost of `--invariant batch` (the default mode, invariant mode, and the default mode again, compared by
# benchmarks/probes/invariant_cost.py), then, with time left, the attention kernel's plans; `matmul` (not in the
# default steps) times the matmul's launch shapes, the TMA candidates among them, against cuBLAS. Everything goes to
# $OUT/invariant.tar.gz (one file: a device call returns at most 8). Before the device call, commit, then
#   python -c "from tpweave.bench.provenance import write_manifest; print(write_manifest())"
# and carry .tpweave-manifest.json. Then from the repository root on the GPU box:
#   bash benchmarks/invariant_session.sh [MODEL] [STEPS...]     (steps: tests cost attention matmul; default the
#   first three; COST_RUNS, e.g. "default batch", names the cost step's runs in order: batch* in invariant mode;
#   ATTENTION_CASES, e.g. "prefill,mixed", the attention probe's cases; ATTENTION_LAYOUT=engine, its pool laid out as
#   the engine's)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src" TPWEAVE_CACHE_DIR="${TPWEAVE_CACHE_DIR:-/tmp/tpwcache}"
MODEL=${1:-llama3-8b}
shift || true
STEPS=${*:-tests cost attention}
OUT="${OUT:-/tmp/invariant_out}"
R="$OUT/invariant"
mkdir -p "$R"
pack() { tar czf "$OUT/invariant.tar.gz" -C "$OUT" invariant; }
trap pack EXIT
for step in $STEPS; do
    case $step in
    tests)
        timeout 420 python -m pytest -v -m gpu tests/test_invariant.py -p no:logging --show-capture=stderr \
            > "$R/gpu-tests.log" 2>&1
        echo "rc=$?" >> "$R/gpu-tests.log" ;;
    cost)
        # default, invariant, default again (COST_RUNS): the last default run against the first is the A/A control
        runs=(${COST_RUNS:-default batch default-again}); defaults=(); invariants=()
        for run in "${runs[@]}"; do
            flags=(); case $run in batch*) flags=(--invariant batch); invariants+=("$R/engine-$run.json") ;;
                                   *) defaults+=("$R/engine-$run.json") ;; esac
            timeout 240 python -m tpweave bench engine --model "$MODEL" -tp 1 --num-iters 48 "${flags[@]}" \
                --output-dir "$R" --name "engine-$run" > "$R/engine-$run.log" 2>&1
            echo "rc=$?" >> "$R/engine-$run.log"
            pack  # each run's files kept if the device call is cut before the next ends
        done
        python benchmarks/probes/invariant_cost.py --default "${defaults[@]}" --invariant "${invariants[@]}" \
            --out "$R/invariant-cost.json" > "$R/invariant-cost.log" 2>&1 ;;
    attention)
        (cd benchmarks/probes && timeout 240 python invariant_attention_probe.py --out "$R" \
            --cases "${ATTENTION_CASES:-}" --layout "${ATTENTION_LAYOUT:-scattered}") > "$R/attention.log" 2>&1
        echo "rc=$?" >> "$R/attention.log" ;;
    matmul)
        timeout "${MATMUL_TIMEOUT_S:-420}" python benchmarks/probes/invariant_mm_probe.py --out "$R" > "$R/matmul.log" 2>&1
        echo "rc=$?" >> "$R/matmul.log" ;;
    *) echo "unknown step: $step" >&2; exit 2 ;;
    esac
done
rm -f "$R"/*.png
