#!/usr/bin/env bash
# The TP=2 measurements the open issues need, as steps that each fit one device call (10 min) and
# leave few files (the device returns at most 8): every step writes its logs and results into
# $OUT/<step>.tar.gz. Before the device call, on the session's machine, after committing:
#   python -c "from tpweave.bench.provenance import write_manifest; print(write_manifest())"
# and carry .tpweave-manifest.json with the call (the device copy's git metadata can lag: with the manifest
# every result records the commit whose sources it ran, bench/provenance.py). Then from the repository root
# on the 2-GPU box, e.g.
#   bash benchmarks/tp2_session.sh tests calibrate8b layer8b
# Steps, in the order to run them (a protocol bug would hang calibration, so tests come first):
#   tests       GPU tests on 2 ranks (ce_overlap / fused all-reduce + norm protocols; SP + async TP under Inductor's
#               CUDA graph trees and graph partition with torch's symm_mem ops; the engine's piecewise graphs at
#               TP=2; invariant "tp" at TP 2 against TP 1), PDL + padding probe
#   calibrate8b calibration table for llama3-8b (every strategy per site shape and M)
#   layer8b     per-op / per-layer arms for llama3-8b with that table
#   latency8b   whole-model TTFT / TPOT for llama3-8b (8 layers) with the table
#   engine8b    the engine at TP=2: decode steps, prefill 2048 and a mixed step against their graph-replayed forwards
#               (SP, async TP and token split inside the piecewise graphs), capture time and memory
#   serve8b     prefill-heavy serving: baseline, auto, its A/A copy and auto without prefill graphs, llama3-8b
#   calibrate70b, layer70b   the same for llama3-70b
#   fp8         calibrate + latency for llama3-8b-fp8 (the 1.10x TTFT target at 8K)
#   invariant8b what `--invariant batch` costs at TP=2 with SP, async TP and token split on, against invariant plain
#               TP (`--baseline`: one graph, the ordered all-reduce): INVARIANT_RUNS (default "plain-batch batch
#               plain-batch-again", each `bench engine` of 48 steps; plain* runs with --baseline, *batch* or *tp*
#               with that level, default* in the default mode, kept but not pooled) compared by
#               benchmarks/probes/invariant_cost.py, the plain* runs the reference and their last against their first
#               the A/A control
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}src" TPWEAVE_CACHE_DIR="${TPWEAVE_CACHE_DIR:-/tmp/tpwcache}"
OUT="${OUT:-/tmp/tp2_out}"
DECODE_TOKENS=1,16,64,256,512,1024,2048,4096,8192
tpw() { python -m tpweave "$@"; }

step() {
    local name=$1 dir
    dir=$(mktemp -d)
    echo "== $name ($(python -c 'from tpweave.bench.provenance import code_version, describe; print(describe(code_version()))')) $(date -u +%FT%TZ)" | tee "$dir/commands.txt"
    case $name in
        tests)
            # the emulated-rank tests (one GPU is enough for them) would not leave time for the probe
            python -m pytest -q -m gpu tests/test_gpu_ops.py tests/test_gpu_pdl.py tests/test_compiler.py tests/test_engine.py tests/test_invariant.py -k "not emulated and (not test_invariant or two_gpus)" -p no:cacheprovider 2>&1 | tee "$dir/pytest.log" | tail -5
            python benchmarks/probes/padding_probe.py --output-dir "$dir/padding_probe.json" 2>&1 | tee "$dir/padding_probe.log" | tail -5 ;;
        calibrate8b | calibrate70b)
            local model=llama3-${name#calibrate}
            echo "tpweave calibrate --model $model -tp 2 --num-tokens $DECODE_TOKENS --num-iters 3 --inner 3" >> "$dir/commands.txt"
            tpw calibrate --model "$model" -tp 2 --num-tokens "$DECODE_TOKENS" --num-iters 3 --inner 3 2>&1 | tee "$dir/calibrate.log" | tail -5
            cp -r "$TPWEAVE_CACHE_DIR" "$dir/cache" ;;
        layer8b | layer70b)
            local model=llama3-${name#layer}
            echo "tpweave bench layer --model $model -tp 2 --num-tokens $DECODE_TOKENS --num-iters 5 --inner 3" >> "$dir/commands.txt"
            tpw bench layer --model "$model" -tp 2 --num-tokens "$DECODE_TOKENS" --num-iters 5 --inner 3 --output-dir "$dir" --overwrite 2>&1 | tee "$dir/layer.log" | tail -5 ;;
        latency8b)
            local args=(--model llama3-8b -tp 2 --num-layers 8 --decode 1x1024,8x1024,32x1024,64x1024,128x1024 --prefill 1x2048,1x8192 --num-iters 5 --inner 3)
            echo "tpweave bench latency ${args[*]}" >> "$dir/commands.txt"
            tpw bench latency "${args[@]}" --output-dir "$dir" --overwrite 2>&1 | tee "$dir/latency.log" | tail -5 ;;
        engine8b)
            echo "tpweave bench engine --model llama3-8b -tp 2" >> "$dir/commands.txt"
            tpw bench engine --model llama3-8b -tp 2 --output-dir "$dir" --overwrite 2>&1 | tee "$dir/engine.log" | tail -8 ;;
        serve8b)
            local args=(--model llama3-8b -tp 2 --arms baseline,auto,auto_aa,prefill_eager --workload azure-code --request-rate inf --num-prompts 200
                        --max-num-seqs 64 --max-num-batched-tokens 8192 --max-model-len 8192)
            echo "tpweave bench serve ${args[*]}" >> "$dir/commands.txt"
            tpw bench serve "${args[@]}" --output-dir "$dir" --overwrite 2>&1 | tee "$dir/serve.log" | tail -5 ;;
        fp8)
            echo "tpweave calibrate --model llama3-8b-fp8 -tp 2 --num-tokens $DECODE_TOKENS --num-iters 3 --inner 3" >> "$dir/commands.txt"
            tpw calibrate --model llama3-8b-fp8 -tp 2 --num-tokens "$DECODE_TOKENS" --num-iters 3 --inner 3 2>&1 | tee "$dir/calibrate.log" | tail -3
            local args=(--model llama3-8b-fp8 -tp 2 --num-layers 8 --prefill 1x2048,1x8192 --decode 1x1024,64x1024 --num-iters 5 --inner 3)
            echo "tpweave bench latency ${args[*]}" >> "$dir/commands.txt"
            tpw bench latency "${args[@]}" --output-dir "$dir" --overwrite 2>&1 | tee "$dir/latency.log" | tail -5 ;;
        invariant8b)
            local refs=() arms=() run flags
            for run in ${INVARIANT_RUNS:-plain-batch batch plain-batch-again}; do
                flags=(--model llama3-8b -tp 2 --num-iters 48)
                case $run in plain*) flags+=(--baseline) ;; esac
                case $run in *batch*) flags+=(--invariant batch) ;; *tp*) flags+=(--invariant tp) ;; esac
                echo "tpweave bench engine ${flags[*]} --name engine-$run" >> "$dir/commands.txt"
                # a run that hangs or fails leaves the others' results (and the pack below) within the device's call
                timeout "${INVARIANT_RUN_TIMEOUT_S:-180}" python -m tpweave bench engine "${flags[@]}" --output-dir "$dir" \
                    --name "engine-$run" > "$dir/engine-$run.log" 2>&1 || echo "rc=$?" >> "$dir/engine-$run.log"
                [ -f "$dir/engine-$run.json" ] || continue
                # plain* the reference, the other invariant runs the arm; a default* run is kept beside them, unpooled
                case $run in plain*) refs+=("$dir/engine-$run.json") ;; *batch* | *tp*) arms+=("$dir/engine-$run.json") ;; esac
            done
            if [ ${#refs[@]} -gt 0 ] && [ ${#arms[@]} -gt 0 ]; then
                python benchmarks/probes/invariant_cost.py --default "${refs[@]}" --invariant "${arms[@]}" \
                    --labels "plain TP" "SP+async TP" --out "$dir/invariant-cost.json" 2>&1 | tee "$dir/invariant-cost.log"
            else
                echo "invariant8b: no plain* or no other run finished: nothing to compare" | tee "$dir/invariant-cost.log"
            fi ;;
        *) echo "unknown step $name" >&2; exit 2 ;;
    esac
    mkdir -p "$OUT"
    tar -czf "$OUT/$name.tar.gz" -C "$dir" .
}

for name in "$@"; do
    step "$name"
done
