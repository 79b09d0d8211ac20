"""Which engine path gives a request's logits other bits in invariant mode (GPU, tiny Llama of
tests/test_invariant.py's WIDE shapes, bf16): one 300-token prompt alone, chunked (256 + 44) or in one step, with CUDA
graphs or without, and first among 256 other requests; every sampled token's logits against the chunked run's.
    python benchmarks/probes/invariant_engine_bisect.py > bisect.log"""

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import workers  # noqa: E402
from tpweave.runtime.context import TPContext  # noqa: E402

WIDE = dict(hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=4, head_dim=64)


def main() -> None:
    rng = random.Random(3)
    probes = [[rng.randrange(1536) for _ in range(n)] for n in (1, 9, 40, 130, 300)]
    others = [[rng.randrange(1536) for _ in range(rng.randrange(1, 40))] for _ in range(256)]
    base = dict(dtype=torch.bfloat16, block_size=16, max_num_seqs=256, max_num_batched_tokens=256, max_model_len=320,
                num_blocks=2000, async_scheduling=False, invariant="batch", model_overrides=WIDE)  # fmt: skip
    one_step = {"max_num_batched_tokens": 8192}
    variants = {
        "chunked": ([probes[4]], {}),
        "one_step": ([probes[4]], one_step),
        "one_step_piecewise": ([probes[4]], {**one_step, "whole_step_graphs": False}),
        "one_step_no_graphs": ([probes[4]], {**one_step, "cuda_graphs": False}),
        "chunked_no_graphs": ([probes[4]], {"cuda_graphs": False}),
        "crowd_256": (probes + others, {**one_step, "num_blocks": 500}),
        "130_then_300_one_step": ([probes[3], probes[4]], one_step),
        "chunked_again": ([probes[4]], {}),
    }
    ref = None
    for name, (prompts, over) in variants.items():
        results, seen, stats, _ = workers.engine_logits(TPContext.single("cuda"), [prompts], {**base, **over})
        keys = sorted((k for k in seen if k[:300] == tuple(probes[4])), key=len)
        if ref is None:
            ref = {k: seen[k] for k in keys}
        same = ["=" if torch.equal(seen[k], ref[k]) else f"x{(seen[k].float() - ref[k].float()).abs().max():.3g}"
                for k in ref]  # fmt: skip
        print(f"{name:24s} {' '.join(same)}  stats={stats}", flush=True)


if __name__ == "__main__":
    main()
