#!/usr/bin/env bash
# Issue 39's comparison on one GPU: one trace through `tpweave serve` (HTTP, streamed) and through the in-process
# client, in one device call (about 7 minutes for llama3-8b on one H200: two engine builds of ~100 s each, the trace
# twice). Results and logs go to $OUT/serve-http.tar.gz (one file: a device call returns at most 8); a call cut short
# returns the loose files under $OUT/serve-http instead, the first 8 of them. Before the device call, commit, then
#   python -c "from tpweave.bench.provenance import write_manifest; print(write_manifest())"
# and carry .tpweave-manifest.json. Then from the repository root on the GPU box:
#   bash benchmarks/serve_http_session.sh [MODEL]
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src" TPWEAVE_CACHE_DIR="${TPWEAVE_CACHE_DIR:-/tmp/tpwcache}"
MODEL=${1:-llama3-8b}
OUT="${OUT:-/tmp/serve_http_out}"
R="$OUT/serve-http"
mkdir -p "$R"
# the in-process client's engine settings (bench serve's defaults), given to the server too
ENGINE=(--max-num-seqs 64 --max-num-batched-tokens 8192 --max-model-len 8192 --block-size 16)
TRACE=(--workload sharegpt --request-rate 16,inf --num-prompts 200 --rounds 2 --seed 0)

python -m tpweave serve --model "$MODEL" -tp 1 --port 8000 "${ENGINE[@]}" > "$R/server.log" 2>&1 &
server=$!
for _ in $(seq 1 180); do grep -q "tpweave: serving" "$R/server.log" && break; sleep 1; done
timeout 240 python -m tpweave bench serve --backend openai --base-url http://127.0.0.1:8000/v1 --model "$MODEL" \
    "${TRACE[@]}" --output-dir "$R" --name "serve-http-$MODEL" > "$R/http.log" 2>&1 || echo "http client rc=$?" >> "$R/http.log"
curl -s localhost:8000/metrics > "$R/server-metrics.txt" || true
kill -TERM "$server"
wait "$server" || echo "server rc=$?" >> "$R/server.log"
timeout 270 python -m tpweave bench serve --model "$MODEL" -tp 1 --arms auto "${ENGINE[@]}" "${TRACE[@]}" \
    --output-dir "$R" --name "serve-inprocess-$MODEL" > "$R/inprocess.log" 2>&1 || echo "rc=$?" >> "$R/inprocess.log"
rm -f "$R"/*.png
tar czf "$OUT/serve-http.tar.gz" -C "$OUT" serve-http && rm -rf "$R"
