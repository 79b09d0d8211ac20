"""Weights in HF layout: which full tensor (and which slice of it) feeds each of this rank's parameters.

One table drives random initialisation, safetensors loading and checkpoint writing, so a TP=1 and a
TP=N build from the same seed or directory hold slices of the same full model.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tpweave.models.config import ModelConfig
from tpweave.ops.fp8 import quantize_weight


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) along `dim` of full tensor `hf_name` (dim None: the whole tensor)."""

    hf_name: str
    dim: int | None
    start: int = 0
    stop: int = 0


LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# Static FP8 input scale of the random presets: inputs up to 8 in magnitude are represented.
RANDOM_STATIC_INPUT_SCALE = 8.0 / 448.0


def _is_quantized_linear(cfg: ModelConfig, name: str) -> bool:
    return cfg.quantization is not None and any(name.endswith(f"{lin}.weight") for lin in LINEARS)


def hf_dtype(cfg: ModelConfig, name: str, dtype: torch.dtype) -> torch.dtype:
    """dtype of tensor `name` in memory: FP8 for quantized linear weights, fp32 for their scales."""
    if name.endswith(("weight_scale", "input_scale")):
        return torch.float32
    if _is_quantized_linear(cfg, name):
        return torch.float8_e4m3fn
    return dtype


def full_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> full (unsharded) shape of every tensor of the model's checkpoint, FP8 scales
    included (per output channel, or () for a static input scale)."""
    H, D = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (cfg.num_heads * D, H),
            p + "self_attn.k_proj.weight": (cfg.num_kv_heads * D, H),
            p + "self_attn.v_proj.weight": (cfg.num_kv_heads * D, H),
            p + "self_attn.o_proj.weight": (H, cfg.num_heads * D),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, H),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, H),
            p + "mlp.down_proj.weight": (H, cfg.intermediate_size),
        }
        if cfg.qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (cfg.num_heads * D,),
                p + "self_attn.k_proj.bias": (cfg.num_kv_heads * D,),
                p + "self_attn.v_proj.bias": (cfg.num_kv_heads * D,),
            }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    if cfg.quantization:
        for name in [n for n in shapes if _is_quantized_linear(cfg, n)]:
            base = name.removesuffix(".weight")
            shapes[base + ".weight_scale"] = (shapes[name][0],)  # per output channel (per-tensor is expanded on load)
            if cfg.activation_scheme == "static":
                shapes[base + ".input_scale"] = ()
    return shapes


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of every tensor of the model's checkpoint in memory (full_shapes at hf_dtype): the weights of all TP
    ranks together, as TP shards them (the (H,) norm weights each rank keeps whole aside)."""
    return sum(math.prod(shape) * hf_dtype(cfg, name, dtype).itemsize for name, shape in full_shapes(cfg).items())


def _rows(name: str, size: int, rank: int, tp: int, dim: int = 0) -> Piece:
    local = size // tp
    return Piece(name, dim, rank * local, (rank + 1) * local)


def param_sources(cfg: ModelConfig, *, rank: int, tp: int) -> dict[str, list[Piece]]:
    """Our parameter name -> the pieces concatenated (dim 0) to fill it on this rank."""
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    src: dict[str, list[Piece]] = {
        "model.embed_tokens.weight": [_rows("model.embed_tokens.weight", cfg.vocab_size, rank, tp)],
        "model.norm.weight": [Piece("model.norm.weight", None)],
    }
    if not cfg.tie_word_embeddings:
        src["lm_head.weight"] = [_rows("lm_head.weight", cfg.vocab_size, rank, tp)]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = [("q_proj", cfg.num_heads * D), ("k_proj", cfg.num_kv_heads * D), ("v_proj", cfg.num_kv_heads * D)]
        src |= {
            p + "input_layernorm.weight": [Piece(p + "input_layernorm.weight", None)],
            p + "post_attention_layernorm.weight": [Piece(p + "post_attention_layernorm.weight", None)],
            p + "self_attn.qkv_proj.weight": [_rows(f"{p}self_attn.{n}.weight", size, rank, tp) for n, size in qkv],
            p + "self_attn.o_proj.weight": [_rows(p + "self_attn.o_proj.weight", cfg.num_heads * D, rank, tp, dim=1)],
            p + "mlp.gate_up_proj.weight": [
                _rows(p + "mlp.gate_proj.weight", I, rank, tp),
                _rows(p + "mlp.up_proj.weight", I, rank, tp),
            ],
            p + "mlp.down_proj.weight": [_rows(p + "mlp.down_proj.weight", I, rank, tp, dim=1)],
        }
        if cfg.qkv_bias:
            src[p + "self_attn.qkv_proj.bias"] = [_rows(f"{p}self_attn.{n}.bias", size, rank, tp) for n, size in qkv]
        if cfg.quantization:
            src |= {
                p + "self_attn.qkv_proj.weight_scale": [
                    _rows(f"{p}self_attn.{n}.weight_scale", size, rank, tp) for n, size in qkv
                ],
                p + "self_attn.o_proj.weight_scale": [Piece(p + "self_attn.o_proj.weight_scale", None)],
                p + "mlp.gate_up_proj.weight_scale": [
                    _rows(p + "mlp.gate_proj.weight_scale", I, rank, tp),
                    _rows(p + "mlp.up_proj.weight_scale", I, rank, tp),
                ],
                p + "mlp.down_proj.weight_scale": [Piece(p + "mlp.down_proj.weight_scale", None)],
            }
            if cfg.activation_scheme == "static":
                # merged projections share one input scale: the largest (no input overflows)
                src |= {
                    p + "self_attn.qkv_proj.input_scale": [
                        Piece(f"{p}self_attn.{n}.input_scale", None) for n, _ in qkv
                    ],
                    p + "self_attn.o_proj.input_scale": [Piece(p + "self_attn.o_proj.input_scale", None)],
                    p + "mlp.gate_up_proj.input_scale": [
                        Piece(p + f"mlp.{n}.input_scale", None) for n in ("gate_proj", "up_proj")
                    ],
                    p + "mlp.down_proj.input_scale": [Piece(p + "mlp.down_proj.input_scale", None)],
                }
    del H
    return src


Fetch = Callable[[Piece], torch.Tensor]


def load_weights(model: nn.Module, cfg: ModelConfig, fetch: Fetch, *, rank: int, tp: int) -> None:
    """Fill each of the model's parameters with this rank's slice, fetching the pieces param_sources names
    (concatenated, or the largest for a merged input scale); ValueError when a shape does not match."""
    params = dict(model.named_parameters(remove_duplicate=False))
    sources = param_sources(cfg, rank=rank, tp=tp)
    for name, param in params.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name not in sources:
            raise AssertionError(f"no weight source for parameter {name}")
        pieces = [fetch(piece) for piece in sources[name]]
        if len(pieces) == 1:
            value = pieces[0]
        elif name.endswith("input_scale"):
            value = torch.stack(pieces).amax(0)
        else:
            value = torch.cat(pieces, dim=0)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"weights for {name} have shape {tuple(value.shape)}, the model expects {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(value)


def _slice(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    return t if piece.dim is None else t.narrow(piece.dim, piece.start, piece.stop - piece.start)


def random_full_tensor(
    cfg: ModelConfig, name: str, *, seed: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The full tensor `name` of the random model `seed`: the same on every rank and for every TP degree."""
    if name.endswith("input_scale"):
        return torch.tensor(RANDOM_STATIC_INPUT_SCALE, device=device)
    if cfg.quantization and (name.endswith("weight_scale") or _is_quantized_linear(cfg, name)):
        # FP8: the bf16 model's weight, quantized per output channel
        base = name.removesuffix("_scale") if name.endswith("weight_scale") else name
        w = random_full_tensor(cfg.replace(quantization=None), base, seed=seed, dtype=torch.float32, device=device)
        wq, scale = quantize_weight(w, per_channel=True)
        return scale if name.endswith("weight_scale") else wq
    shape = full_shapes(cfg)[name]
    gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    t = torch.empty(shape, dtype=torch.float32, device=device).normal_(generator=gen)
    if name.endswith("norm.weight"):
        t = 1.0 + 0.1 * t
    elif name.endswith(".bias"):
        t = 0.1 * t
    elif "embed_tokens" not in name:
        t = t * shape[-1] ** -0.5
    return t.to(hf_dtype(cfg, name, dtype))


def random_fetch(cfg: ModelConfig, *, seed: int, dtype: torch.dtype, device: torch.device) -> Fetch:
    """A Fetch that slices the tensors of the random model `seed` (random_full_tensor)."""

    def fetch(piece: Piece) -> torch.Tensor:
        return _slice(random_full_tensor(cfg, piece.hf_name, seed=seed, dtype=dtype, device=device), piece).contiguous()

    return fetch


def random_hf_state(
    cfg: ModelConfig, *, seed: int, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Every full tensor of the random model `seed`, by HF name: a whole checkpoint's state dict."""
    return {
        name: random_full_tensor(cfg, name, seed=seed, dtype=dtype, device=torch.device(device))
        for name in full_shapes(cfg)
    }


class SafetensorsFetch:
    """Reads only the requested slice of each tensor from an HF directory of *.safetensors files."""

    def __init__(self, path: str | Path, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device):
        from safetensors import safe_open

        self.path = Path(path)
        self.dtype, self.device = dtype, device
        self.expected = full_shapes(cfg)
        self.cfg = cfg
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.path} holds no *.safetensors files")
        self.handles = {}
        self.where: dict[str, Path] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ValueError(f"cannot read {f}: {e}") from e
            self.handles[f] = handle
            for key in handle.keys():
                self.where[key] = f

    def check(self) -> None:
        """ValueError naming the first tensor the model needs that the checkpoint lacks or holds in another shape
        (headers only: nothing is read)."""
        for name in self.expected:
            self._shape(name)

    def _shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in the checkpoint, checked against config.json (scales: per tensor or per channel)."""
        f = self.where.get(name)
        if f is None:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {self.path}")
        shape = tuple(self.handles[f].get_slice(name).get_shape())
        want = self.expected[name]
        scale = name.endswith(("weight_scale", "input_scale")) and shape in ((), (1,), (*want, 1), want)
        if shape != want and not scale:
            raise ValueError(f"tensor {name!r} in {f.name} has shape {shape}, config.json implies {want}")
        return shape

    def __call__(self, piece: Piece) -> torch.Tensor:
        """This piece of its tensor, read from the checkpoint onto the device in its in-memory dtype (hf_dtype);
        scales are read whole (a per-tensor weight scale expanded to per channel). ValueError for a missing
        tensor or a shape that config.json does not imply."""
        shape = self._shape(piece.hf_name)
        f = self.where[piece.hf_name]
        sl = self.handles[f].get_slice(piece.hf_name)
        want = self.expected[piece.hf_name]
        if piece.hf_name.endswith(("weight_scale", "input_scale")) and shape in ((), (1,), (*want, 1), want):
            # scales: per-tensor (() or (1,)) or per-channel ((N,) or (N, 1)), read whole (small)
            t = sl[:] if shape else self.handles[f].get_tensor(piece.hf_name)
            t = t.reshape(-1).float()
            t = t.expand(want).contiguous() if t.numel() == 1 and want else t.reshape(want)
            return _slice(t, piece).to(self.device).contiguous()
        if piece.dim is None:
            t = sl[:]
        elif piece.dim == 0:
            t = sl[piece.start : piece.stop]
        else:
            t = sl[:, piece.start : piece.stop]
        return t.to(device=self.device, dtype=hf_dtype(self.cfg, piece.hf_name, self.dtype)).contiguous()


def check_checkpoint(path: str | Path, cfg: ModelConfig) -> None:
    """ValueError unless the directory's *.safetensors hold every tensor of cfg in the shape config.json implies
    (their headers are read, nothing else): what a run on it would otherwise find out only after its ranks start."""
    SafetensorsFetch(path, cfg, dtype=torch.bfloat16, device=torch.device("cpu")).check()


def save_hf_checkpoint(
    path: str | Path, cfg: ModelConfig, state: dict[str, torch.Tensor], *, num_files: int = 1
) -> None:
    """Write config.json and `num_files` safetensors files (+ index when several), HF naming."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    names = sorted(state)
    chunks = [names[i::num_files] for i in range(num_files)]
    weight_map = {}
    for i, chunk in enumerate(chunks):
        fname = "model.safetensors" if num_files == 1 else f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        save_file({n: state[n].contiguous().cpu() for n in chunk}, str(path / fname), metadata={"format": "pt"})
        weight_map |= {n: fname for n in chunk}
    if num_files > 1:
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
        )
