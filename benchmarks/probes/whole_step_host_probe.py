"""Where the host's time goes when the engine runs a prefill or a mixed step from its graph of the whole step: the
host time (after a sync: no wait for the GPU) of building the step's inputs (runner.whole_step) and of the call that
runs it, that call split into its phases (the free pinned buffer, the fields' writes, the pending rows, the one
upload, the graph's replay), beside the replay of one CUDA graph of the plain forward (`bench engine`'s yardstick).
Medians of --calls calls; the steps as `bench engine` builds them (64 decodes at context 1024 + a fresh 512-token
chunk; a 2048-token prefill).

    python benchmarks/probes/whole_step_host_probe.py [--model llama3-8b] [--num-layers 32] [--out DIR]
"""

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import torch
from mixed_host_probe import host_ms  # this directory's: host time per call after a sync

from tpweave.bench.stats import median
from tpweave.bench.timing import capture
from tpweave.engine import LLMEngine
from tpweave.engine.scheduler import ScheduledChunk
from tpweave.engine.sequence import Sequence
from tpweave.runtime.context import TPContext


def chunks_of(engine, decodes: int, context: int, chunk: int) -> list[ScheduledChunk]:
    rng, blocks, chunks = random.Random(2), engine.scheduler.blocks, []
    for _ in range(decodes):
        seq = Sequence([rng.randrange(engine.vocab_size) for _ in range(context)])
        blocks.grow(seq, context)
        chunks.append(ScheduledChunk(seq, context - 1, 1, samples=True))
    seq = Sequence([rng.randrange(engine.vocab_size) for _ in range(chunk)])
    blocks.grow(seq, chunk)
    chunks.append(ScheduledChunk(seq, 0, chunk, samples=True))
    return chunks


def whole_step_engine(model: str, num_layers: int) -> LLMEngine:
    """An engine on the GPU with graphs of whole steps for the two steps timed here (576 and 2048 tokens)."""
    return LLMEngine(TPContext.single("cuda"), model, num_layers=num_layers, max_num_seqs=80,
                     max_num_batched_tokens=2048, max_model_len=2100, prefill_graph_sizes=(576, 2048))  # fmt: skip


class Phases:
    """Host time of the named methods of some objects, per call (wrapped in place while `on`)."""

    def __init__(self):
        self.ms: dict[str, list[float]] = defaultdict(list)
        self.on = False

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.on:
                self.ms[name].append((time.perf_counter() - t) * 1e3)
            return out

        setattr(obj, attr, timed)


class GraphProxy:
    def __init__(self, graph, phases: Phases):
        self.graph = graph
        phases.wrap(self, "replay", "replay")

    def replay(self):
        self.graph.replay()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    engine = whole_step_engine(args.model, args.num_layers)
    runner = engine.runner
    phases = Phases()
    staged = runner._step_staged
    phases.wrap(staged, "host", "host_buffer")
    phases.wrap(staged, "upload", "upload")
    phases.wrap(runner, "_write_pending", "pending_rows")
    for key, graph in list(runner.step_graphs.items()):
        runner.step_graphs[key] = GraphProxy(graph, phases)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
              "num_layers": args.num_layers, "step_graphs": len(runner.step_graphs)}  # fmt: skip
    steps = {"mixed 64x1024 + 512": (64, 1024, 512), "prefill 2048": (0, 0, 2048)}
    with torch.no_grad():
        for name, shape in steps.items():
            chunks = chunks_of(engine, *shape)
            build = host_ms(lambda chunks=chunks: runner.whole_step(chunks), args.calls)
            whole = runner.whole_step(chunks)
            assert whole is not None, f"{name}: no graph of the whole step serves it"
            run = whole[1]
            for _ in range(3):
                run()
            phases.ms.clear()
            phases.on = True
            total = host_ms(run, args.calls)
            phases.on = False
            split = {k: median(v) for k, v in phases.ms.items()}
            split["fields_and_rest"] = median(total) - sum(split.values())
            step_args = runner._inputs(chunks, pad_to=whole[0])
            reference = capture(lambda step_args=step_args: runner.forward(*step_args), None)
            record[name] = {
                "build_ms": median(build),
                "run_ms": median(total),
                "run_ms_samples": total,
                "run_phases_ms": split,
                "reference_graph_replay_ms": median(host_ms(reference, args.calls)),
                "event_create_record_ms": median(host_ms(lambda: torch.cuda.Event().record(), args.calls)),
            }
            print(name, json.dumps(record[name], default=float)[:600], flush=True)
            for c in chunks:
                engine.scheduler.blocks.free(c.seq)
    out = Path(args.out) / f"whole_step_host_probe-{args.model}-{args.num_layers}layers.json"
    out.write_text(json.dumps(record, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
