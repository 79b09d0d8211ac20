"""The torch.compile side of tpweave: SP and async-TP passes, dynamic M, the report."""

from tpweave.compiler.backend import DEFAULT_OVERLAP_POLICY, DEFAULT_SP_MIN_TOKENS, CompiledTP, compile, report
from tpweave.compiler.report import CompileReport

__all__ = ["CompiledTP", "CompileReport", "DEFAULT_OVERLAP_POLICY", "DEFAULT_SP_MIN_TOKENS", "compile", "report"]
