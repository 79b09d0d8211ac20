from tpweave.ops import attention, collectives, fp8, overlap  # noqa: F401  (registers the torch.library ops)
