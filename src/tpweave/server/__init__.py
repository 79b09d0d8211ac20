"""`tpweave serve`: an OpenAI-compatible HTTP server over the engine at any TP (server/worker.py runs it on every
rank: rank 0 serves HTTP, every rank runs the same engine steps)."""
