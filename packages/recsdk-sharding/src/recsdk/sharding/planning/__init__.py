"""Planning: how TorchRec's planner sees recsdk's hash tables, and which tables a plan caches.

Modules: :mod:`.planner` (the enumerator and the storage estimate that count the id tables),
:mod:`.cost_model` (the perf estimate of a hash-table shard and of a plan), :mod:`.hybrid_costs`
(the measured constants and a shard's costs), :mod:`.cache_costs` (a cached table as the planner
sees it: its cache, its ``fused`` kernel, its rows' bytes, its miss rate),
:mod:`.sharding_planner` (``HybridEmbeddingShardingPlanner``: TorchRec's planner with both) and
:mod:`.cache_plan` (the cached tables of a plan, and the plan and module TorchRec builds their
kernels from). The public names are exported by :mod:`recsdk.sharding`.
"""
