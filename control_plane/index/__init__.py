"""The global prefix index: which worker holds which chained KV block hashes, in which tier.

Pure core only (no I/O): :mod:`.native` is the index, over the Rust core in ``native/``;
:mod:`.shapes` what it answers; :mod:`.errors` what it refuses. The block hashes come from
:mod:`common.hashing`. Its executable specification, in pure Python, is the differential oracle
``tests/oracles/prefix_index.py``.
"""
