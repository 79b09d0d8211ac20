"""Which Hugging Face architectures tpweave's invariant mode makes batch-invariant, on the CPU at TP 1.

For each architecture: a random checkpoint of hf_tp_plan_sweep.tiny_config's layer pattern, wide enough that torch's
fp32 CPU matmul gives a row other bits at other M (hidden 512); its forward compiled with invariant="batch" (strict
off); prompts of 1, 6 and 37 tokens alone and as the last row of right-padded batches with sequences of 40 and of 100
and 3 tokens. Prints, per architecture, whether each prompt's logits in each batch are bitwise those alone, the
largest |logit error| alone against the eager model, and what the report lists as not invariant. A row that differs
with nothing listed is a hole in the guarantee; one listed is the report doing its job.

    python benchmarks/probes/hf_invariant_sweep.py llama,gpt2,mixtral > sweep.log

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
def check(arch: str) -> dict:
    from transformers import AutoModelForCausalLM

    import tpweave
    from tpweave.compiler import CompileOptions

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import hf_tp_plan_sweep as sweep

    sweep.TINY.update(WIDE)
    torch.manual_seed(0)
    config = sweep.tiny_config(arch)
    config.pad_token_id = 0
    model = AutoModelForCausalLM.from_config(config).eval()
    forward = tpweave.compile(model.forward, options=CompileOptions(invariant="batch"))
    g = torch.Generator().manual_seed(1)
    equal, err = [], 0.0
    for length in (1, 6, 37):
        target = torch.randint(1, 256, (length,), generator=g)
        alone = forward(input_ids=target[None], attention_mask=torch.ones(1, length, dtype=torch.long)).logits[0]
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
    from tpweave.bench.provenance import source_hash

    return {"equal": equal, "err_vs_eager": err, "not_invariant": left, "source_hash": source_hash()}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        try:
            result = check(sys.argv[2])
        except Exception as e:  # noqa: BLE001  (a probe: report and go on)
            result = {"error": f"{type(e).__name__}: {e}"[:400], "traceback": traceback.format_exc()[-800:]}
        print("RESULT", json.dumps(result), flush=True)
        return
    import transformers

    from tpweave.bench.provenance import code_version, versions

    provenance = {"code": code_version(), "versions": versions(), "transformers": transformers.__version__}
    print("PROVENANCE", json.dumps(provenance), flush=True)
    for arch in sys.argv[1].split(","):
        run = subprocess.run([sys.executable, __file__, "--one", arch], capture_output=True, text=True, timeout=900)
        lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
        result = json.loads(lines[-1][7:]) if lines else {"error": f"exit {run.returncode}: {run.stderr[-300:]}"}
        if "equal" in result:
            listed = bool(result["not_invariant"])
            if listed:
                result["verdict"] = "reported"
            else:
                result["verdict"] = "invariant" if all(result["equal"]) else "NOT INVARIANT, unreported"

        else:
            result["verdict"] = "error"
        print(arch, json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
