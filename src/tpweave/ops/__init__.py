from tpweave.ops import attention, collectives, overlap  # noqa: F401  (registers the torch.library ops)
