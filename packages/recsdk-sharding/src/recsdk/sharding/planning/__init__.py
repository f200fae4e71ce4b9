"""Planning: how TorchRec's planner sees recsdk's hash tables, and which tables a plan caches.

Modules: :mod:`.planner` (the enumerator and the storage estimate that count the id tables),
:mod:`.cost_model` (the perf estimate of a hash-table shard, from measured constants),
:mod:`.sharding_planner` (``HybridEmbeddingShardingPlanner``: TorchRec's planner with both) and
:mod:`.cache_plan` (the cached tables of a plan, and the plan and module TorchRec builds their
kernels from). The public names are exported by :mod:`recsdk.sharding`.
"""
