"""The measured strategy table: per collective site shape, which strategy wins for which M, and
from which M the sequence-parallel graph beats the plain TP graph. Cached as JSON, keyed by GPU,
TP degree, dtype, torch version and the model's site shapes."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tpweave.log import logger
from tpweave.models.config import ModelConfig
from tpweave.ops.strategies import check_policy

TABLE_VERSION = 1


@dataclass(frozen=True)
class SiteShape:
    """kind 'ag_mm': (shard rows, K) gathered, times (K, N); 'mm_rs': (M, K) x (K, N), scattered;
    'all_reduce': (M, K) summed over ranks (n == k); 'all_reduce_rms_norm': the same, then residual add +
    RMSNorm (fused, or the all-reduce strategy then one add + norm kernel)."""

    kind: str
    k: int
    n: int

    @property
    def name(self) -> str:
        """ "kind:KxN": the site's key in a table's policies."""
        return f"{self.kind}:{self.k}x{self.n}"


def site_shapes(cfg: ModelConfig, tp: int) -> list[SiteShape]:
    """The collective sites of the model under TP degree `tp`: gathers before the QKV, gate/up and LM-head
    matmuls, reduce-scatters after o_proj and down_proj, the all-reduce with and without the norm
    (scaled-matmul kinds for FP8 models)."""
    H, D = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * D // tp
    # FP8 models: the decoder's linears are scaled matmuls (the LM head stays in the model dtype)
    ag, rs = ("ag_scaled_mm", "scaled_mm_rs") if cfg.quantization == "fp8" else ("ag_mm", "mm_rs")
    return [
        SiteShape(ag, H, qkv),
        SiteShape(ag, H, 2 * cfg.intermediate_size // tp),
        SiteShape("ag_mm", H, cfg.vocab_size // tp),
        SiteShape(rs, cfg.num_heads * D // tp, H),
        SiteShape(rs, cfg.intermediate_size // tp, H),
        SiteShape("all_reduce", H, H),
        SiteShape("all_reduce_rms_norm", H, H),
    ]


def device_name() -> str:
    """The CUDA device's name, "cpu" without CUDA."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def table_key(cfg: ModelConfig, *, tp: int, dtype: torch.dtype, device: str | None = None) -> dict[str, Any]:
    """What a table is valid for: table version, GPU name (default: this one), TP degree, dtype, torch
    version and the model's site shape names."""
    return {
        "version": TABLE_VERSION,
        "device": device or device_name(),
        "tp": tp,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__.split("+")[0],
        "shapes": sorted({s.name for s in site_shapes(cfg, tp)}),
    }


@dataclass
class StrategyTable:
    """Per site shape name the policy string that picks its strategy by M, the M from which the SP graph
    serves (sp_min_tokens) and the M from which the token-split graph serves below it (None: never); `key`
    (table_key) says what it was measured for."""

    key: dict[str, Any]
    policies: dict[str, str] = field(default_factory=dict)  # site shape name -> policy string
    sp_min_tokens: int = 512
    measurements: dict[str, Any] = field(default_factory=dict)  # raw medians, for the record
    token_split_min_tokens: int | None = None  # the token-split graph from this M on, below sp_min_tokens

    def policy(self, kind: str, k: int, n: int, default: str = "sequential") -> str:
        """The policy of the site (kind, k, n); `default` when the table has none for it."""
        return self.policies.get(SiteShape(kind, k, n).name, default)

    def to_json(self) -> str:
        """The table as JSON text, measurements included: what from_json reads."""
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> StrategyTable:
        """Parse and validate a table; ValueError says what is malformed (schema, a policy string, an
        unknown strategy name)."""
        raw = json.loads(text)
        if (
            not isinstance(raw, dict)
            or not isinstance(raw.get("key"), dict)
            or not isinstance(raw.get("policies"), dict)
        ):
            raise ValueError("expected an object with 'key' and 'policies' objects")
        sp_min = raw.get("sp_min_tokens")
        if isinstance(sp_min, bool) or not isinstance(sp_min, int) or sp_min < 0:
            raise ValueError(f"sp_min_tokens must be an integer >= 0, got {sp_min!r}")
        split = raw.get("token_split_min_tokens")
        if split is not None and (isinstance(split, bool) or not isinstance(split, int) or split < 4):
            raise ValueError(f"token_split_min_tokens must be an integer >= 4 or null, got {split!r}")
        for site, policy in raw["policies"].items():
            if not isinstance(policy, str):
                raise ValueError(f"policy of {site} is not a string: {policy!r}")
            try:
                check_policy(policy)
            except ValueError as e:
                raise ValueError(f"site {site}: {e}") from None
        return cls(key=raw["key"], policies=dict(raw["policies"]), sp_min_tokens=sp_min,
                   measurements=raw.get("measurements", {}), token_split_min_tokens=split)  # fmt: skip


def cache_dir() -> Path:
    """Where tables are cached: $TPWEAVE_CACHE_DIR, else ~/.cache/tpweave."""
    return Path(os.environ.get("TPWEAVE_CACHE_DIR", Path.home() / ".cache" / "tpweave"))


def table_path(key: dict[str, Any]) -> Path:
    """Cache file of the table for `key`, named by device, TP degree, dtype and a hash of the whole key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "tables" / f"{key['device'].replace(' ', '_')}-tp{key['tp']}-{key['dtype']}-{digest}.json"


def save_table(table: StrategyTable) -> Path:
    """Write the table to its cache file (through a temporary file, so never half-written); the path."""
    path = table_path(table.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(table.to_json())
    tmp.replace(path)  # never leave a half-written table behind
    return path


def load_table(key: dict[str, Any]) -> StrategyTable | None:
    """The cached table for `key`, or None (with one log line saying why and what would help)."""
    path = table_path(key)
    if not path.exists():
        logger.info(
            "no calibration table for %s TP=%s %s: built-in defaults (run `tpweave calibrate` to tune)",
            key["device"],
            key["tp"],
            key["dtype"],
        )
        return None
    try:
        table = StrategyTable.from_json(path.read_text())
    except (ValueError, KeyError, TypeError) as e:
        logger.warning(
            "calibration table %s is corrupt (%s): ignored, using built-in defaults; `tpweave calibrate` rebuilds it",
            path,
            e,
        )
        return None
    if table.key != key:
        logger.warning(
            "calibration table %s is stale (made for %s): ignored; `tpweave calibrate` rebuilds it", path, table.key
        )
        return None
    return table
