"""Which Hugging Face architectures tpweave's invariant mode makes batch-invariant, on the CPU at TP 1.

For each architecture: a random checkpoint of hf_tp_plan_sweep.tiny_config's layer pattern, wide enough that torch's
fp32 CPU matmul gives a row other bits at other M (hidden 512); its forward compiled with invariant="batch" (strict
off); prompts of 1, 6 and 37 tokens alone and as the last row of right-padded batches with sequences of 40 and of 100
and 3 tokens. Prints, per architecture, whether each prompt's logits in each batch are bitwise those alone, the
largest |logit error| alone against the eager model, and what the report lists as not invariant. A row that differs
with nothing listed is a hole in the guarantee; one listed is the report doing its job.

    python benchmarks/probes/hf_invariant_sweep.py llama,gpt2,mixtral > sweep.log
    python benchmarks/probes/hf_invariant_sweep.py qwen2,mixtral --level tp --tp 2   # under their own TP plans

At TP >= 2 the checkpoint is loaded with transformers' own TP plan (tp_plan="auto") on gloo ranks; at level "tp"
each prompt's logits alone are also compared with TP 1's (same_as_tp_1).

One architecture per process (Dynamo's recompile limit is shared by every model of one class in a process).
"""

from __future__ import annotations

import json
import subprocess
import sys
import traceback

import torch

WIDE = dict(
    vocab_size=256,
    hidden_size=512,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=512,
)


@torch.no_grad()
def check(ctx, arch: str, path: str, level: str) -> dict:
    """One rank's part (ctx: tpweave's TPContext); at TP >= 2 the checkpoint loaded with transformers' own TP plan."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DistributedConfig

    import tpweave
    from tpweave.bench.provenance import source_hash
    from tpweave.compiler import CompileOptions

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import hf_tp_plan_sweep as sweep

    torch._dynamo.reset()
    if ctx.rank == 0:
        sweep.TINY.update(WIDE)
        torch.manual_seed(0)
        config = sweep.tiny_config(arch)
        config.pad_token_id = 0
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    if ctx.world_size > 1:
        dist.barrier()
    extra = {"distributed_config": DistributedConfig(tp_plan="auto")} if ctx.world_size > 1 else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()
    forward = tpweave.compile(model.forward, options=CompileOptions(invariant=level, sp_min_tokens=64))
    g = torch.Generator().manual_seed(1)
    equal, alones, err = [], [], 0.0
    for length in (1, 6, 37):
        target = torch.randint(1, 256, (length,), generator=g)
        alone = forward(input_ids=target[None], attention_mask=torch.ones(1, length, dtype=torch.long)).logits[0]
        alones.append(alone)
        err = max(err, (alone - model(input_ids=target[None]).logits[0]).abs().max().item())
        for others in ([40], [100, 3]):
            seqs = [torch.randint(1, 256, (n,), generator=g) for n in others] + [target]
            ids = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, s in enumerate(seqs):
                ids[i, : len(s)], mask[i, : len(s)] = s, 1
            equal.append(torch.equal(forward(input_ids=ids, attention_mask=mask).logits[-1, :length], alone))
    left: dict[str, int] = {}
    for graph in tpweave.report(forward).graphs:
        for name, count in graph.invariant.get("not_invariant", {}).items():
            left[name] = max(left.get(name, 0), count)
    return {
        "equal": equal,
        "err_vs_eager": err,
        "not_invariant": left,
        "calls": dict(forward.calls),
        "source_hash": source_hash(),
        "alones": alones,
    }


def one(arch: str, level: str, tp: int) -> dict:
    """The check at TP 1, or at `tp` ranks (gloo); at level "tp" also whether their logits are TP 1's."""
    import tempfile

    import tpweave
    from tpweave.runtime.context import TPContext

    path = tempfile.mkdtemp(prefix=f"hf-{arch}-")
    if tp == 1:
        result = check(TPContext.single(), arch, path, level)
    else:
        result = tpweave.launch(check, arch, path, level, nprocs=tp, timeout_s=900)[0]
        if level == "tp":
            single = check(TPContext.single(), arch, path, level)
            result["same_as_tp_1"] = all(torch.equal(a, b) for a, b in zip(result["alones"], single["alones"]))
    del result["alones"]
    return result


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archs", help="comma-separated transformers model types (llama,gpt2,mixtral)")
    parser.add_argument("--level", choices=("batch", "tp"), default="batch")
    parser.add_argument("--tp", type=int, default=1, help="ranks (gloo), the model under its own TP plan from 2")
    parser.add_argument("--timeout-s", type=float, default=1800, help="seconds an architecture may take (default 1800)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        try:
            result = one(args.archs, args.level, args.tp)
        except Exception as e:  # noqa: BLE001  (a probe: report and go on)
            # the message's end: a rank's traceback ends with the exception that stopped it
            result = {"error": f"{type(e).__name__}: {e}"[-600:], "traceback": traceback.format_exc()[-800:]}
        print("RESULT", json.dumps(result), flush=True)
        return
    import transformers

    from tpweave.bench.provenance import code_version, versions

    provenance = {"code": code_version(), "versions": versions(), "transformers": transformers.__version__}
    print("PROVENANCE", json.dumps(provenance | {"level": args.level, "tp": args.tp}), flush=True)
    for arch in args.archs.split(","):
        command = [sys.executable, __file__, arch, "--one", "--level", args.level, "--tp", str(args.tp)]
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            result = {"error": f"timed out after {args.timeout_s:g} s"}
        else:
            lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
            result = json.loads(lines[-1][7:]) if lines else {"error": f"exit {run.returncode}: {run.stderr[-300:]}"}
        if "equal" not in result:
            result["verdict"] = "error"
        elif result["not_invariant"]:
            result["verdict"] = "reported"
        elif not all(result["equal"]) or result.get("same_as_tp_1") is False:
            result["verdict"] = "NOT INVARIANT, unreported"
        else:
            result["verdict"] = "invariant"
        print(arch, json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
