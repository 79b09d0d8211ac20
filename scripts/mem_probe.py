"""Probe: peak CUDA memory per submodule during an eager paged prefill step (diagnostic)."""
import sys

import torch

from tpweave.models import build_model
from tpweave.runtime.context import TPContext

M = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
ctx = TPContext.single("cuda")
m = build_model("llama3-8b", tp=ctx, dtype=torch.bfloat16, num_layers=2)
for layer in m.model.layers:
    layer.self_attn.k_cache = torch.zeros(M, 8, 128, dtype=torch.bfloat16, device="cuda")
    layer.self_attn.v_cache = torch.zeros(M, 8, 128, dtype=torch.bfloat16, device="cuda")
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
print("allocated before", torch.cuda.memory_allocated() / 2**30)


def hook(name):
    def fn(mod, inp, out):
        torch.cuda.synchronize()
        print(f"{name:<40} peak {torch.cuda.max_memory_allocated() / 2**30:8.2f} GiB  now {torch.cuda.memory_allocated() / 2**30:8.2f}")
    return fn


for name, mod in m.named_modules():
    mod.register_forward_hook(hook(name))
dev = "cuda"
ids = torch.zeros(M, dtype=torch.long, device=dev)
pos = torch.arange(M, device=dev)
cu = torch.tensor([0, M], dtype=torch.int32, device=dev)
table = torch.arange(M // 16, dtype=torch.int32, device=dev)[None]
with torch.no_grad():
    m(ids, pos, cu, pos, cu[1:], table, 16, cu[1:] - 1)
