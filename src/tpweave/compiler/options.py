"""`tpweave.compile`'s options: one frozen object, validated when built, and the plan it becomes once
the process group, the model and the calibration table are known.

Defaults without a calibration table (docs/architecture.md, "Defaults", has the measurements):
sequence parallelism from M >= DEFAULT_SP_MIN_TOKENS on NCCL groups with torch's fused ops there, and
on NCCL groups the plain graph's all-reduce fused with the residual add + RMSNorm after it. On gloo
(CPU) there is nothing to measure: the SP graph serves every M, so CPU runs exercise it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from tpweave.compiler.piecewise import PIECEWISE_CUT_OPS, PiecewiseGraphs
from tpweave.compiler.tp_group import TPGroup
from tpweave.log import logger
from tpweave.ops import pdl
from tpweave.ops.strategies import check_policy
from tpweave.ops.strategies.ordered import BY_LEVEL
from tpweave.tuning.table import SiteShape, StrategyTable

if TYPE_CHECKING:
    from tpweave.compiler.report import CompileReport

DEFAULT_SP_MIN_TOKENS = 2048
DEFAULT_OVERLAP_POLICY = "sequential@0,symm_mem_fused@2048"
DEFAULT_AR_NORM_POLICY = "triton_ar_norm"


INVARIANT_LEVELS = (None, "batch", "tp")  # CompileOptions.invariant


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """How `tpweave.compile` rewrites and compiles a TP module. None means "decide from the group, the
    table and the backend" (see the module doc). Policies are strategy policy strings
    ("name" or "name@M,name@M,..."; ops/strategies/contract.py) for sites the table does not list."""

    sp: bool | None = None  # sequence parallelism (+ async TP); None: on when TP > 1
    async_tp: bool = True  # fuse the SP graph's all-gathers / reduce-scatters with their matmuls
    sp_min_tokens: int | None = None  # the SP graph from this M on, the plain TP graph below
    # below sp_min_tokens, from this M on: the plain graph run as two token subsets whose all-reduces overlap the
    # other subset's compute (compiler/token_split.py); None: the table's (calibration), else off
    token_split_min_tokens: int | None = None
    # each subset's all-reduce + residual + RMSNorm as one kernel on at most this many SMs on a side stream (where
    # the kernel runs: CUDA, symmetric memory, TP a power of 2); 0: the process group's all-reduce, Inductor's norm
    token_split_sms: int = 8
    # linear layers through tpweave::linear: a one-kernel Triton GEMV at <= 16 rows on CUDA, torch's matmul above
    # (compiler/decode_gemv.py); every arm and baseline of the benchmarks gets it alike
    decode_gemv: bool = True
    # with decode_gemv: a residual add + RMSNorm read by one linear layer alone goes into that layer's op (one GEMV
    # that normalizes as it reads at one row); off by default: slower in the engine's batch-1 step on one H200
    # (docs/architecture.md, "The decode-GEMV pass")
    norm_gemv: bool = False
    # Inductor stores a pointwise result that several kernels read (the residual stream: each layer's x + attn(...)
    # feeds its RMSNorm and the next add) instead of recomputing it in every reader; by default it does so only past
    # 4 reads, so each add + RMSNorm re-read up to 4 earlier summands (llama3-8b, 2048 tokens on one H200: 17-30 us
    # a norm where one pass over its input takes 17). Every arm and PLAIN_TP get it alike.
    realize_residuals: bool = True
    table: StrategyTable | Literal["auto"] | None = "auto"  # "auto": the cached table of a tpweave model
    ag_mm_policy: str = DEFAULT_OVERLAP_POLICY
    mm_rs_policy: str = DEFAULT_OVERLAP_POLICY
    all_reduce_policy: str = "sequential"
    all_reduce_rms_norm_policy: str | None = None  # None: triton_ar_norm on NCCL, else not fused
    cudagraphs: bool = False  # Inductor's CUDA graph trees
    piecewise: bool = False  # Inductor graph partition, cut at the attention ops, each piece in CUDA graph trees
    # the engine's piecewise CUDA graphs (compiler/piecewise.py): Inductor graph partition, cut at the attention ops
    # and at tpweave::select_rows, every piece called through this object (not with cudagraphs / piecewise)
    piecewise_graphs: PiecewiseGraphs | None = None
    num_tokens_fn: Callable[[tuple], int] | None = None  # M from the call's arguments
    strict: bool = False  # a failure inside tpweave's passes raises instead of compiling without them
    # "batch": each token's results bitwise the same whatever other tokens share the call (compiler/invariant.py);
    # "tp": also the same at TP = 1, 2, 4 and 8; None: off
    invariant: str | None = None

    def __post_init__(self) -> None:
        for name in ("async_tp", "cudagraphs", "piecewise", "strict", "decode_gemv", "norm_gemv", "realize_residuals"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"option {name} must be True or False, got {getattr(self, name)!r}")
        if self.sp is not None and not isinstance(self.sp, bool):
            raise TypeError(f"option sp must be True, False or None, got {self.sp!r}")
        if self.sp_min_tokens is not None and (
            isinstance(self.sp_min_tokens, bool) or not isinstance(self.sp_min_tokens, int) or self.sp_min_tokens < 0
        ):
            raise ValueError(f"sp_min_tokens must be >= 0 (an integer, or None), got {self.sp_min_tokens!r}")
        split = self.token_split_min_tokens
        # >= 4: both subsets get >= 2 rows (a 1-row subset would make Inductor specialize, one more graph)
        if split is not None and (isinstance(split, bool) or not isinstance(split, int) or split < 4):
            raise ValueError(f"token_split_min_tokens must be >= 4 (an integer, or None), got {split!r}")
        sms = self.token_split_sms
        if isinstance(sms, bool) or not isinstance(sms, int) or not 0 <= sms <= 1024:
            raise ValueError(f"token_split_sms must be an integer in [0, 1024] (0: off), got {sms!r}")
        if not (self.table is None or self.table == "auto" or isinstance(self.table, StrategyTable)):
            raise ValueError(f"table must be a StrategyTable, None or 'auto', got {self.table!r}")
        for site, policy in self.table.policies.items() if isinstance(self.table, StrategyTable) else ():
            try:
                check_policy(policy)
            except ValueError as e:
                raise ValueError(f"table: site {site}: {e}") from None
        for name in ("ag_mm_policy", "mm_rs_policy", "all_reduce_policy", "all_reduce_rms_norm_policy"):
            policy = getattr(self, name)
            if policy is not None:
                try:
                    check_policy(policy)
                except ValueError as e:
                    raise ValueError(f"option {name}: {e}") from None
        if self.invariant not in INVARIANT_LEVELS:
            raise ValueError(f"option invariant must be one of {INVARIANT_LEVELS}, got {self.invariant!r}")
        if self.piecewise_graphs is not None:
            if not isinstance(self.piecewise_graphs, PiecewiseGraphs):
                raise TypeError(
                    f"piecewise_graphs must be a PiecewiseGraphs, got {type(self.piecewise_graphs).__name__}"
                )
            if self.cudagraphs or self.piecewise:
                raise ValueError(
                    "piecewise_graphs (the engine's own piecewise CUDA graphs) and cudagraphs / piecewise (Inductor's "
                    "CUDA graph trees) both capture the same pieces: choose one"
                )
        if self.num_tokens_fn is not None and not callable(self.num_tokens_fn):
            raise TypeError(f"num_tokens_fn must be callable, got {type(self.num_tokens_fn).__name__}")

    def replace(self, overrides: Mapping[str, Any]) -> CompileOptions:
        """A copy with `overrides` (option name -> value); an unknown name is a TypeError listing the valid ones."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise TypeError(f"tpweave.compile got unknown option(s) {', '.join(unknown)}; options: {', '.join(names)}")
        return dataclasses.replace(self, **overrides) if overrides else self

    def inductor_config(self) -> dict[str, Any]:
        """Inductor config patches these options imply."""
        config: dict[str, Any] = {}
        if self.cudagraphs or self.piecewise:
            config["triton.cudagraphs"] = True
        if self.piecewise or self.piecewise_graphs is not None:
            config["graph_partition"] = True
            config["custom_should_partition_ops"] = list(PIECEWISE_CUT_OPS)
        if self.realize_residuals:
            config["realize_reads_threshold"] = 1  # a pointwise node of 2+ reads and 2+ users is stored once
        from torch._inductor import config as inductor

        if pdl.requested() and hasattr(inductor.triton, "enable_pdl"):
            config["triton.enable_pdl"] = True  # Inductor's kernels launch as ours do (ops/pdl.py), where PDL runs
        if self.invariant is not None:
            # one kernel configuration per reduction, picked without timing (Inductor's autotuning would choose by
            # measured speed, so two compiles could reduce a row in different orders), and no split reductions
            for name in ("deterministic", "batch_invariant"):
                if hasattr(inductor, name):
                    config[name] = True
            config.update({k: v for k, v in _ONE_ROW_AS_MANY.items() if _has_config(inductor, k)})  # where it has them
        return config


def _has_config(module: Any, dotted: str) -> bool:
    *parents, name = dotted.split(".")
    for parent in parents:
        module = getattr(module, parent, None)
    return hasattr(module, name)


# A token dim of size 1 gets a graph of its own (compiler/dynamic.py). Inductor would reduce that graph's single row
# unlike the dynamic graph's rows: variance by Welford there and in two steps where the rows are many, a long row split
# over CPU threads or over GPU blocks (a split picked for few rows), a short row (< 8 elements: a router's softmax over
# its experts) summed as a chain of adds where the rows are many but over SIMD lanes (a tree) where there is one row
# on the CPU. These make every graph reduce a row one way.
_ONE_ROW_AS_MANY = {
    "split_reductions": False,
    "unroll_reductions_threshold": 1,  # no short reduction unrolled into adds (Inductor's "disable with 1")
    "cpp.min_chunk_size": 1 << 62,  # no CPU kernel parallel over a reduction (nor over rows: row-wise work is small)
    "cpp.use_two_step_variance_threshold": 0,  # Welford at every row count
    "triton.use_two_step_variance_threshold": 0,
    # No CPU kernel vectorized: a loop Inductor vectorizes in one graph and not in another (a softmax's sink logit, one
    # element a row: vectorized over the heads of a one-token graph, scalar among many rows) computes exp and the other
    # transcendental functions by SLEEF there and by libm here, an ulp apart. On a GPU every kernel calls one function.
    "cpp.simdlen": 1,
}


# The arm every comparison is against: plain TP, the model's NCCL all-reduces, Inductor's own add + norm.
PLAIN_TP = CompileOptions(sp=False, table=None, all_reduce_policy="sequential", all_reduce_rms_norm_policy="sequential")


@dataclass(frozen=True)
class PassOptions:
    """What the passes do to one graph variant: "sp" (sequence parallel, async TP), "split" (the plain graph as
    two token subsets) or "plain"."""

    sp: bool
    async_tp: bool
    ag_mm_policy: str = "sequential"  # default for sites the table does not list
    mm_rs_policy: str = "sequential"
    all_reduce_policy: str = "sequential"
    all_reduce_rms_norm_policy: str = "sequential"  # "sequential": not fused (Inductor's add + norm)
    site_policies: tuple[tuple[str, str], ...] = ()  # (SiteShape name, policy), from the table
    token_split: bool = False  # the plain graph as two interleaved token subsets (compiler/token_split.py)
    token_split_sms: int = 0  # > 0: their all-reduce + norm fused on a side stream on this many SMs
    decode_gemv: bool = False  # linear layers through tpweave::linear (compiler/decode_gemv.py), after the passes
    norm_gemv: bool = False  # ... and residual add + RMSNorm + linear through tpweave::rms_norm_linear
    invariant: str | None = None  # "batch": matmuls and attention as batch-invariant kernels (compiler/invariant.py)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The dispatched op kinds this variant's graph may hold."""
        if self.sp:
            return ("ag_mm", "mm_rs", "ag_scaled_mm", "scaled_mm_rs") if self.async_tp else ()
        return () if self.token_split else ("all_reduce", "all_reduce_rms_norm")

    def policy(self, kind: str, k: int, n: int) -> str:
        """The policy of a site of `kind` and shape (k, n): the table's, else this variant's default.
        FP8 sites stay sequential unless the table lists a measured strategy for them."""
        defaults = {
            "ag_mm": self.ag_mm_policy,
            "mm_rs": self.mm_rs_policy,
            "all_reduce": self.all_reduce_policy,
            "all_reduce_rms_norm": self.all_reduce_rms_norm_policy,
        }
        return dict(self.site_policies).get(SiteShape(kind, k, n).name, defaults.get(kind, "sequential"))

    def policies(self, kinds: tuple[str, ...] | None = None) -> list[str]:
        """Every policy a site of this variant may carry (of `kinds`, default all of its kinds): the
        defaults and the table's."""
        kinds = self.kinds if kinds is None else kinds
        defaults = [self.policy(kind, -1, -1) for kind in kinds]  # no site has shape -1
        listed = [self.policy(*_site_key(site)) for site, _ in self.site_policies if _site_key(site)[0] in kinds]
        return defaults + listed


def _site_key(name: str) -> tuple[str, int, int]:
    kind, _, shape = name.partition(":")
    k, _, n = shape.partition("x")
    return kind, int(k), int(n)


@dataclass(frozen=True)
class CompilePlan:
    """The options with every default decided: the graph variants, the SP boundary, the table used."""

    variants: dict[str, PassOptions]
    sp_min_tokens: int
    table: str  # which calibration table, in words, for the report
    strict: bool = False
    inductor_config: dict[str, Any] = field(default_factory=dict)
    token_split_min_tokens: int | None = None  # the "split" variant from this M on (below sp_min_tokens)
    piecewise_graphs: PiecewiseGraphs | None = None  # Inductor's partition wrapper while compiling

    def agreement(self) -> dict[str, Any]:
        """What every rank must have decided alike (else their graphs' collectives would not match)."""
        return {"sp_min_tokens": self.sp_min_tokens, "token_split_min_tokens": self.token_split_min_tokens,
                **{n: dataclasses.asdict(v) for n, v in self.variants.items()}}  # fmt: skip

    def new_report(self) -> CompileReport:
        """An empty report for this plan."""
        from tpweave.compiler.report import CompileReport

        return CompileReport(sp_min_tokens=self.sp_min_tokens if "sp" in self.variants else None, table=self.table)


def plan(options: CompileOptions, tp: TPGroup, module: object) -> CompilePlan:
    """Decide every default of `options` for this group and module (see the module doc)."""
    table, table_text = _table(options.table, module, tp)
    nccl = tp.backend == "nccl"
    sp_min = options.sp_min_tokens
    if sp_min is None:
        sp_min = table.sp_min_tokens if table is not None else DEFAULT_SP_MIN_TOKENS if nccl else 0
    # With one rank the fused kernel has nothing to exchange and is slower than Inductor's own add + norm
    # (one H200: benchmarks/results/2026-12-02/layer-llama3-8b-tp1-1xH200.md, auto vs plain_nccl at M = 128).
    fuse_norm = nccl and tp.world_size > 1
    ar_norm = options.all_reduce_rms_norm_policy or (DEFAULT_AR_NORM_POLICY if fuse_norm else "sequential")
    site_policies = tuple(sorted(table.policies.items())) if table is not None else ()
    invariant = options.invariant is not None
    ordered = BY_LEVEL.get(options.invariant)  # the strategy every site runs under in invariant mode
    if invariant:  # every cross-rank sum in one fixed order (ops/strategies/ordered.py), the norm left to Inductor
        site_policies, ar_norm = (), "sequential"
    common = dict(site_policies=site_policies)
    # not the SP graph: it serves M in the thousands
    # invariant: the decode GEMV is another kernel at one row than above it, so it stays off
    gemv = dict(decode_gemv=options.decode_gemv and options.invariant is None,
                norm_gemv=options.norm_gemv and options.invariant is None, invariant=options.invariant)  # fmt: skip
    all_reduce = ordered or options.all_reduce_policy
    variants = {"plain": PassOptions(False, False, all_reduce_policy=all_reduce,
                                     all_reduce_rms_norm_policy=ar_norm, **common, **gemv)}  # fmt: skip
    if options.sp if options.sp is not None else tp.world_size > 1:  # with one rank SP only adds copies
        # invariant: async TP's ops under the ordered strategy (their overlap kept), the reduce-scatter + norm not
        # fused (that norm would be another kernel than the plain graph's)
        variants["sp"] = PassOptions(True, options.async_tp, ag_mm_policy=ordered or options.ag_mm_policy,
                                     mm_rs_policy=ordered or options.mm_rs_policy, invariant=options.invariant,
                                     **common)  # fmt: skip
    split_min = options.token_split_min_tokens
    if split_min is None and table is not None:
        split_min = table.token_split_min_tokens
    if tp.world_size == 1:  # nothing to overlap
        split_min = None
    if split_min is not None:
        # invariant: the subsets' all-reduces as all-gathers summed in rank order (at level "tp" of the products' fp32
        # subtrees: allreduce.order_all_reduces); the side stream's fused all-reduce + norm off (its sum is the
        # kernel's own)
        sms = 0 if invariant else options.token_split_sms
        variants["split"] = PassOptions(False, False, token_split=True, token_split_sms=sms, **common, **gemv)
    return CompilePlan(
        variants, sp_min, table_text, options.strict, options.inductor_config(), split_min, options.piecewise_graphs
    )


def _table(table: StrategyTable | str | None, module: object, tp: TPGroup) -> tuple[StrategyTable | None, str]:
    """The calibration table to use, and a line saying which (or why none) for the report."""
    if isinstance(table, StrategyTable):
        return table, "given"
    if table is None:
        return None, "none (table=None): built-in defaults"
    from tpweave.models.config import ModelConfig
    from tpweave.tuning.table import load_table, table_key

    cfg = getattr(module, "config", None)
    param = next(module.parameters(), None) if isinstance(module, torch.nn.Module) else None
    if tp.world_size == 1:
        return None, "none (one rank): built-in defaults"
    if not isinstance(cfg, ModelConfig) or param is None:
        return None, (
            f"none: table='auto' finds tables measured for tpweave's own models; this {type(module).__name__} "
            "gets the built-in defaults (pass table=tpweave.tuning.load_table(...) to use one)"
        )
    found = load_table(table_key(cfg, tp=tp.world_size, dtype=param.dtype))
    if found is None:
        logger.info("no calibration table: built-in defaults (tpweave calibrate would tune this)")
        return None, "none measured for this device, TP and dtype: built-in defaults (tpweave calibrate measures one)"
    return found, "calibrated (tpweave calibrate)"
