"""What a checkpoint reads off the model: how its hash tables are laid out over the ranks, and
the per-table state saved beside the rows (admission counters, scores, fused optimizer counters).

The hash modules themselves are found by :mod:`recsdk.sharding.writing.hash_modules`, which
checkpoints share with exports and publications.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recsdk.embedding import CountAdmission, HashEmbeddingBagConfig, HashEmbeddingConfig, ScoreAdmission, ScoreEviction
from recsdk.sharding import _torchrec_compat as compat
from recsdk.sharding.writing.hash_modules import HashModule

__all__ = ["TableLayout", "admission_counters", "fused_counters", "layouts", "score_layout"]


@dataclass
class TableLayout:
    """How one table is split: ``shards`` is ``[(rank, row_offset, rows)]`` sorted by rank."""

    sharding_type: str
    num_embeddings: int
    embedding_dim: int
    shards: list[tuple[int, int, int]]

    def rows_on(self, rank: int) -> int:
        """Rows the table has on ``rank`` (0 if none)."""
        return sum(rows for r, _, rows in self.shards if r == rank)


def layouts(module: HashModule) -> dict[str, TableLayout]:
    """Every table's layout over all ranks, from the module's sharding plan."""
    configs = module.table_configs
    out = {}
    for name, ps in module.module_sharding_plan.items():
        cfg = configs[name]
        spec = ps.sharding_spec
        shards = sorted(
            (int(s.placement.rank()), int(s.shard_offsets[0]), int(s.shard_sizes[0]))
            for s in spec.shards  # type: ignore[union-attr]
        )
        out[name] = TableLayout(str(ps.sharding_type), int(cfg.num_embeddings), int(cfg.embedding_dim), shards)
    return out


def admission_counters(module: HashModule, table: str) -> int:
    """Number of admission counters the table's id tables hold (0 without a count-min sketch)."""
    cfg = module.table_configs.get(table)
    admission = cfg.admission if isinstance(cfg, HashEmbeddingBagConfig | HashEmbeddingConfig) else None
    if not isinstance(admission, CountAdmission) or admission.threshold <= 1:
        return 0
    return (admission.counter_slots // admission.num_hashes) * admission.num_hashes


def score_layout(module: HashModule, table: str) -> tuple[bool, int]:
    """What show/click scores the table's id tables keep: per-row scores (score eviction) and how
    many admission counters (score admission; 0 without)."""
    cfg = module.table_configs.get(table)
    admission = getattr(cfg, "admission", None)
    counters = 0
    if isinstance(admission, ScoreAdmission):
        counters = (admission.counter_slots // admission.num_hashes) * admission.num_hashes
    return isinstance(getattr(cfg, "eviction", None), ScoreEviction), counters


def fused_counters(module: HashModule) -> dict[str, dict[str, torch.Tensor]]:
    """Per local table, fused optimizer state that is not per row (e.g. an Adam step count).

    Per-row state (sharded tensors, and tensors with one entry per local row) is saved with the
    table's rows; what remains are small counters, saved per shard.
    """
    optimizer = module.fused_optimizer
    state = optimizer.state
    views = module.table_views()
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name in module.id_tables:
        param = optimizer.params.get(module.parameter_key(name))
        per_row = {views[name].weight.shape[0], module.kernel_rows(name)}  # a cached table's store and cache
        found = {}
        for skey, value in (state.get(param, {}) if param is not None else {}).items():
            if compat.is_sharded_tensor(value) or not isinstance(value, torch.Tensor):
                continue
            if value.dim() >= 1 and value.shape[0] in per_row:
                continue
            found[skey] = value
        out[name] = found
    return out
