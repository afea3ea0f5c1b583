"""The global prefix index: which worker holds which chained KV block hashes, in which tier.

Pure core only (no I/O): :mod:`.hashing` computes vLLM-compatible block hashes,
:mod:`.prefix_index` folds KV and worker lifecycle events into a queryable projection.
"""
