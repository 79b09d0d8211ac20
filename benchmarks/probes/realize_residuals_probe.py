"""The compiled forward of one fresh sequence with and without `realize_residuals` (compiler/options.py), llama3-8b
on one GPU (TP=1, bf16, random weights): GPU time per forward (3 calls back to back, the two settings alternated,
so both see the same clocks), the add + RMSNorm kernels' time per forward (torch.profiler), and the largest
difference between the two settings' logits.

    python benchmarks/probes/realize_residuals_probe.py [--model llama3-8b] [--tokens 2048] [--rounds 12] [--out F]
"""

import argparse
import json

import torch
from prefill_kernels_probe import CALLS, profile_forward

import tpweave
from tpweave.bench.timing import time_call
from tpweave.models import build_model
from tpweave.models.inputs import random_batch
from tpweave.runtime.context import TPContext


def norm_kernels_ms(fn) -> tuple[float, dict[str, float]]:
    """GPU time per call of the kernels that compute an RMSNorm (Inductor names them after rsqrt), by name."""
    by_name = {k["name"]: k["us_per_call"] / 1e3 for k in profile_forward(fn, stack=False)["kernels"]}
    by_name = {name: ms for name, ms in by_name.items() if "rsqrt" in name}
    return sum(by_name.values()), by_name


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=12, help="timed samples of each setting, alternated")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    ctx = TPContext.single(torch.device("cuda"))
    model = build_model(args.model, tp=ctx, dtype=torch.bfloat16)
    batch = random_batch([args.tokens], vocab_size=model.config.vocab_size, device=ctx.device)
    inputs = batch.args()
    settings = {"realize_residuals": True, "inductor default": False}
    compiled = {name: tpweave.compile(model, realize_residuals=on) for name, on in settings.items()}
    logits = {}
    with torch.no_grad():
        for name, fn in compiled.items():
            for _ in range(3):  # compile, warm up
                logits[name] = fn(*inputs)
        samples: dict[str, list[float]] = {name: [] for name in compiled}
        for r in range(args.rounds):
            order = list(compiled) if r % 2 == 0 else list(reversed(compiled))
            for name in order:
                samples[name].append(time_call(lambda fn=compiled[name]: fn(*inputs), inner=CALLS, on_cuda=True))
        norms = {name: norm_kernels_ms(lambda fn=fn: fn(*inputs)) for name, fn in compiled.items()}
    diff = (logits["realize_residuals"].float() - logits["inductor default"].float()).abs().max().item()
    result = {"model": args.model, "tokens": args.tokens, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "max_abs_logit_diff": diff, "settings": {}}  # fmt: skip
    for name in compiled:
        s = sorted(samples[name])
        result["settings"][name] = {"forward_ms_median": s[len(s) // 2], "forward_ms_samples": samples[name],
                                    "norm_kernels_ms": norms[name][0], "norm_kernels": norms[name][1]}  # fmt: skip
        print(f"{name:>18}: forward {s[len(s) // 2]:.3f} ms (median of {len(s)}, {s[0]:.3f}-{s[-1]:.3f}); "
              f"add + RMSNorm kernels {norms[name][0]:.3f} ms a forward", flush=True)  # fmt: skip
        for kernel, ms in sorted(norms[name][1].items(), key=lambda kv: -kv[1]):
            print(f"{'':>20}{ms * 1e3:9.1f} us  {kernel}")
    print(f"largest |logit difference| between the settings: {diff:.4g}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
