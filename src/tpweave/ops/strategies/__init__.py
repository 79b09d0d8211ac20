"""One overlap strategy per file; each registers itself in tpweave.ops.overlap.STRATEGIES."""
