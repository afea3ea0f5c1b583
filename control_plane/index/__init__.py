"""The global prefix index: which worker holds which chained KV block hashes, in which tier.

Pure core only (no I/O): :mod:`.prefix_index` folds KV and worker lifecycle events into a
queryable projection (the reference), :mod:`.native` is the production index over the Rust core,
:mod:`.implementation` picks one. The block hashes come from :mod:`common.hashing`.
"""
