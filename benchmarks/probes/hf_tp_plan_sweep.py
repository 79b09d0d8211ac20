"""Which Hugging Face architectures tpweave compiles with SP, as their users run TP.

For each architecture: a tiny random checkpoint (save_pretrained, safetensors), loaded on every rank
with transformers' own tensor parallelism (from_pretrained(tp_plan="auto")), compiled by tpweave with
SP forced, called like HF models are (input_ids=...) at several (batch, seq) shapes. Prints, per
architecture, the max |logit error| of eager TP and of the compiled model against the unsharded one,
the number of graphs, the collectives before / after the passes, and the report's notes.

    torchrun --nproc_per_node=2 benchmarks/probes/hf_tp_plan_sweep.py llama,mixtral,phi3 /tmp/hf_ckpt

Needs transformers and accelerate; CPU (gloo) is enough. One architecture per process is cleaner:
Dynamo's recompile limit is shared by every model of one class in a process.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

import tpweave

SHAPES = [(1, 1), (2, 3), (3, 16), (1, 33)]
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    moe_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    shared_expert_intermediate_size=64,
    pad_token_id=0,
    n_routed_experts=4,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    rotary_dim=8,
)


# architectures whose layer pattern comes from periods, not from a per-layer list
PATTERN = {
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "bamba": dict(attn_layer_indices=[1]),
}


def tiny_config(arch: str):
    """TINY sizes; of a per-layer pattern (layer_types, mlp_layer_types, ...) the first layer of each
    distinct kind, so hybrid models keep both their attention and their linear-attention / SSM layers."""
    default = CONFIG_MAPPING[arch]()
    fields = default.to_dict()
    # attribute_map: configs like gptj's name the fields n_embd, n_layer, ... (hidden_size is an alias)
    names = {key: default.attribute_map.get(key, key) for key in TINY}
    kwargs = {names[key]: value for key, value in TINY.items() if names[key] in fields}
    num_layers = default.num_hidden_layers
    per_layer = {
        k: v for k, v in fields.items() if isinstance(v, list) and len(v) == num_layers and k.endswith("types")
    }
    if per_layer:
        kinds = list(zip(*per_layer.values()))
        keep = sorted({kinds.index(kind) for kind in kinds})
        keep = keep if len(keep) >= 2 else list(range(min(2, num_layers)))
        kwargs |= {k: [v[i] for i in keep] for k, v in per_layer.items()} | {names["num_hidden_layers"]: len(keep)}
    kwargs |= PATTERN.get(arch, {})
    if "qk_rope_head_dim" in fields:  # MLA: the rotary part is the head_dim the rotary embedding sees
        kwargs[names["head_dim"]] = TINY["qk_rope_head_dim"]
    if "kv_lora_rank" in fields:  # MLA: every query head has its own K and V, as in the released checkpoints
        kwargs[names["num_key_value_heads"]] = kwargs[names["num_attention_heads"]]
    return CONFIG_MAPPING[arch](**kwargs)


@torch.no_grad()
def check(arch: str, root: str, rank: int, stage: list[str]) -> dict:
    path = os.path.join(root, arch)
    if rank == 0 and not os.path.exists(path):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(tiny_config(arch)).save_pretrained(path)
    dist.barrier()
    inputs = [torch.randint(0, TINY["vocab_size"], s, generator=torch.Generator().manual_seed(sum(s))) for s in SHAPES]
    stage[0] = "unsharded"
    unsharded = AutoModelForCausalLM.from_pretrained(path).eval()
    want = [unsharded(input_ids=ids).logits for ids in inputs]
    stage[0] = "eager TP"
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
    eager = [model(input_ids=ids).logits for ids in inputs]
    stage[0] = "tpweave"
    compiled = tpweave.compile(model, sp_min_tokens=0)
    got = [compiled(input_ids=ids).logits for ids in inputs]
    rep = tpweave.report(compiled)
    err = lambda outs: max((o.float() - w).abs().max().item() for o, w in zip(outs, want))  # noqa: E731
    return {
        "eager_err": err(eager),
        "compiled_err": err(got),
        "num_graphs": rep.num_compiles,
        "graphs": [(g.counts_before, g.counts_after) for g in rep.graphs],
        "notes": list(dict.fromkeys(list(rep.notes) + [n for g in rep.graphs for n in g.notes])),
    }


def main() -> None:
    archs, root = sys.argv[1].split(","), sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for arch in archs:
        stage = ["building"]
        try:
            result = check(arch, root, rank, stage)
        except Exception as e:  # noqa: BLE001  (a probe: report and go on)
            result = {
                "error": f"{stage[0]}: {type(e).__name__}: {e}"[:500],
                "traceback": traceback.format_exc()[-1500:],
            }
        if rank == 0:
            print(arch, json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
