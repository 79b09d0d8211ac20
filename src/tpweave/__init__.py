"""tpweave: sequence parallelism and async tensor parallelism for TP LLM inference in PyTorch."""

from tpweave import ops  # noqa: F401  (registers tpweave:: ops)
from tpweave.compiler import compile, report
from tpweave.runtime import TPContext, WorkerError, init_distributed, launch
from tpweave.version import __version__

__all__ = ["compile", "report", "TPContext", "WorkerError", "init_distributed", "launch", "__version__"]
