"""Ops registered with torch.library (token collectives, attention, FP8 matmul, decode-size linear layers, the
strategy-dispatched ops) and the strategies behind them."""

from tpweave.ops import attention, collectives, dispatched_ops, fp8, gemv  # noqa: F401  (registers the torch.library ops)
