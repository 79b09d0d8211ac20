"""The torch.compile side of tpweave: the SP and async-TP passes, dynamic M, the report."""

from tpweave.compiler.api import compile, report
from tpweave.compiler.compiled import CompiledTP
from tpweave.compiler.options import (
    DEFAULT_OVERLAP_POLICY,
    DEFAULT_SP_MIN_TOKENS,
    PLAIN_TP,
    CompileOptions,
    PassOptions,
)
from tpweave.compiler.report import CompileReport
from tpweave.compiler.tp_group import TPGroup

__all__ = [
    "DEFAULT_OVERLAP_POLICY",
    "DEFAULT_SP_MIN_TOKENS",
    "PLAIN_TP",
    "CompileOptions",
    "CompileReport",
    "CompiledTP",
    "PassOptions",
    "TPGroup",
    "compile",
    "report",
]
