"""The host stage: a sharded hash module's id work on the host, between the id all-to-all and the lookup.

Modules: :mod:`.host_shards` (``HostShards``: the parts one module holds, built from its plan,
and the module's steps over them), :mod:`.host_stage` (``IdMappingStage``: this rank's id table
per shard, their lock, ids mapped to rows), :mod:`.row_ledger` (``RowLedger``: the rows a batch
in flight holds, and the resets owed when it computes) and :mod:`.table_workers`
(``TableWorkers``: one task per table on up to ``host_threads`` threads). The public names are
exported by :mod:`recsdk.sharding`.
"""
