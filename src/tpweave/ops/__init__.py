from tpweave.ops import attention, collectives  # noqa: F401  (registers the torch.library ops)
