"""Ops registered with torch.library (token collectives, attention, FP8 matmul, decode-size linear layers, the
strategy-dispatched ops, the selection of the rows whose logits are wanted) and the strategies behind them."""

from tpweave.ops import attention, collectives, dispatched_ops, fp8, gemv, invariant, select_rows  # noqa: F401  (registers the torch.library ops)
