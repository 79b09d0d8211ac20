"""How much of the engine's prefill forward is host launch time: the compiled forward of one fresh sequence of N
tokens launched as the engine launches it (eagerly) against the same forward captured once as a CUDA graph and
replayed, and both against the matmul roofline (bench/engine.py's FLOP count at the bf16 GEMM rate measured here).
If the replay is much faster, CUDA-graph (bucketed) prefill is worth building.

    python benchmarks/probes/prefill_graph_probe.py [--model llama3-8b] [--tokens 2048,1024] [--out FILE.json]
"""

import argparse
import json

import torch

from tpweave.bench.engine import _event_ms, gemm_flops_per_s, prefill_flops
from tpweave.bench.stats import median
from tpweave.engine import LLMEngine
from tpweave.engine.scheduler import ScheduledChunk
from tpweave.engine.sequence import Sequence
from tpweave.runtime.context import TPContext


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--tokens", default="2048,1024")
    parser.add_argument("--out")
    args = parser.parse_args()
    counts = [int(t) for t in args.tokens.split(",")]
    ctx = TPContext.single("cuda")
    engine = LLMEngine(ctx, args.model, max_num_batched_tokens=max(counts), max_model_len=max(counts) + 8)
    runner, model = engine.runner, engine.runner.model
    peak = gemm_flops_per_s(ctx.device, torch.bfloat16)
    rows = []
    for n in counts:
        seq = Sequence(list(range(1, n + 1)))
        engine.scheduler.blocks.grow(seq, n)
        inputs = runner._inputs([ScheduledChunk(seq, 0, n, samples=True)])
        with torch.no_grad():
            eager = _event_ms(lambda: runner.forward(*inputs), reps=10)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                runner.forward(*inputs)
            replay = _event_ms(graph.replay, reps=10)
        engine.scheduler.blocks.free(seq)
        roofline = prefill_flops(model, n) / peak * 1e3
        rows.append(dict(tokens=n, eager_ms=median(eager), graph_ms=median(replay), roofline_ms=roofline,
                         eager_of_roofline=roofline / median(eager), graph_of_roofline=roofline / median(replay),
                         eager_samples=eager, graph_samples=replay))  # fmt: skip
        print({k: round(v, 4) for k, v in rows[-1].items() if not k.endswith("samples")}, flush=True)
    engine.release()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "model": args.model, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
