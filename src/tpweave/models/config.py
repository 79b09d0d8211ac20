"""Model configuration and the named presets (real dimensions; weights are random unless loaded)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions and options of a Llama-family decoder, named as in the code (num_kv_heads: GQA K/V
    heads; quantization None or "fp8"; rope_scaling as in HF's config.json, None for plain RoPE)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    # "fp8": linear layers of the decoder in e4m3 with per-channel weight scales (embedding, norms
    # and LM head stay in the model dtype); activation scales "dynamic" (per token) or "static".
    quantization: str | None = None
    activation_scheme: str = "dynamic"

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with the given fields changed."""
        return dataclasses.replace(self, **changes)

    def check_tp(self, tp: int) -> None:
        """ValueError naming every dimension that the TP degree does not divide."""
        if tp < 1:
            raise ValueError(f"TP degree must be >= 1, got {tp}")
        bad = [
            f"{label}={value}"
            for label, value in (
                ("num_heads", self.num_heads),
                ("num_kv_heads", self.num_kv_heads),
                ("intermediate_size", self.intermediate_size),
                ("vocab_size", self.vocab_size),
            )
            if value % tp
        ]
        if bad:
            raise ValueError(f"TP={tp} does not divide {', '.join(bad)} of model {self.name!r}")

    def to_hf(self) -> dict[str, Any]:
        """This config as an HF config.json dict (llama, or qwen2 when qkv_bias)."""
        return {
            "architectures": ["Qwen2ForCausalLM" if self.qkv_bias else "LlamaForCausalLM"],
            "model_type": "qwen2" if self.qkv_bias else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
            **(
                {
                    "quantization_config": {
                        "quant_method": self.quantization,
                        "activation_scheme": self.activation_scheme,
                    }
                }
                if self.quantization
                else {}
            ),
        }

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, name: str = "hf") -> ModelConfig:
        """The config of an HF config.json dict (llama, qwen2 or mistral, SwiGLU, unquantized or FP8 without
        block-wise scales); ValueError for anything else or a missing key."""
        model_type = hf.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise ValueError(
                f"unsupported model_type {model_type!r} (tpweave loads llama, qwen2 and mistral-style checkpoints)"
            )
        quant = hf.get("quantization_config") or {}
        if quant and quant.get("quant_method") != "fp8":
            raise ValueError(
                f"unsupported quantization_config.quant_method {quant.get('quant_method')!r} (supported: fp8)"
            )
        if quant.get("weight_block_size"):
            raise ValueError(
                "block-wise FP8 weight scales (weight_block_size) are not supported: per-tensor or per-channel only"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}: only SwiGLU (silu) MLPs are supported")
        try:
            num_heads = hf["num_attention_heads"]
            hidden = hf["hidden_size"]
            return cls(
                name=name,
                vocab_size=hf["vocab_size"],
                hidden_size=hidden,
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=hf.get("num_key_value_heads") or num_heads,
                head_dim=hf.get("head_dim") or hidden // num_heads,
                rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
                rope_theta=hf.get("rope_theta", 10000.0),
                rope_scaling=hf.get("rope_scaling"),
                max_position_embeddings=hf.get("max_position_embeddings", 4096),
                tie_word_embeddings=hf.get("tie_word_embeddings", False),
                qkv_bias=hf.get("attention_bias", model_type == "qwen2"),
                quantization="fp8" if quant else None,
                activation_scheme=quant.get("activation_scheme", "dynamic"),
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks required key {e.args[0]!r}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """The config of an HF-format model directory (its config.json), named after the directory; ValueError
        without one."""
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{path} is not an HF-format model directory: no config.json")
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{cfg_path}: not a readable JSON file ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{cfg_path}: expected a JSON object, got {type(raw).__name__}")
        return cls.from_hf(raw, name=Path(path).name)


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig("llama3-8b", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0, _LLAMA3_ROPE, 131072),
    "llama3-70b": ModelConfig("llama3-70b", 128256, 8192, 28672, 80, 64, 8, 128, 1e-5, 500000.0, _LLAMA3_ROPE, 131072),
    "llama2-7b": ModelConfig("llama2-7b", 32000, 4096, 11008, 32, 32, 32, 128, 1e-5, 10000.0, None, 4096),
    "qwen2.5-7b": ModelConfig(
        "qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4, 128, 1e-6, 1000000.0, None, 32768, qkv_bias=True
    ),
    "llama3-8b-fp8": None,  # filled below: the bf16 preset with FP8 linear layers
    "llama3-70b-fp8": None,
    "tiny-fp8": None,
    # GQA 2:1; heads, kv heads, MLP and vocab divisible by TP 2, 3, 4, 6 and 8: CPU tests and demos.
    "tiny": ModelConfig("tiny", 1536, 384, 768, 2, 48, 24, 8, 1e-5, 500000.0, _LLAMA3_ROPE, 4096),
}

for _name in [n for n, c in PRESETS.items() if c is None]:
    PRESETS[_name] = PRESETS[_name.removesuffix("-fp8")].replace(name=_name, quantization="fp8")


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The preset `name` with `overrides` (ModelConfig fields) applied; ValueError for an unknown name."""
    if name not in PRESETS:
        hint = " (a path: no such directory)" if "/" in name or name.startswith(".") else ""
        raise ValueError(
            f"{name!r} is neither a model preset ({', '.join(sorted(PRESETS))}) nor an HF-format model directory{hint}"
        )
    cfg = PRESETS[name]
    return cfg.replace(**overrides) if overrides else cfg
