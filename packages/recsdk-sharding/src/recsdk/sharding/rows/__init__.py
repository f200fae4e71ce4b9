"""Rows: where a sharded hash table's embedding rows and optimizer state live, and how they change.

Modules: :mod:`.tbe_views` (the fused kernel's weight and optimizer-state views per table, and
row resets), :mod:`.row_store` (every row of a cached shard in host memory or memory-mapped
files), :mod:`.row_cache` (``TableCache``: a cached table's rows swapped between its store and
the kernel's slots) and :mod:`.host_adam` (Adam on the CPU kernel, applied at the end of
backward). The public names are exported by :mod:`recsdk.sharding`.
"""
