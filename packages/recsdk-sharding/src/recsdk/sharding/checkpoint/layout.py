"""What a checkpoint reads off the model: its sharded hash modules and how their tables are laid out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ParameterSharding
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.optim.keyed import KeyedOptimizer

from recsdk.embedding import (
    CountAdmission,
    HashEmbeddingBagCollection,
    HashEmbeddingBagConfig,
    HashEmbeddingCollection,
    HashEmbeddingConfig,
    IdTable,
    ScoreAdmission,
    ScoreEviction,
)
from recsdk.embedding.change_tracker import ChangeSnapshot
from recsdk.sharding import _torchrec_compat as compat
from recsdk.sharding.host_sharded_module import HostShardedModule, sharded_hash_modules
from recsdk.sharding.row_ledger import RowLedger
from recsdk.sharding.rows.tbe_views import TableViews

__all__ = [
    "HashModule",
    "TableLayout",
    "admission_counters",
    "fused_counters",
    "hash_modules",
    "hash_weight_keys",
    "host_group",
    "layouts",
    "root",
    "score_layout",
    "weight_key",
]


def root(model: nn.Module) -> nn.Module:
    """The module ``DistributedModelParallel`` wraps (state-dict keys are relative to it), else ``model``."""
    return model.module if isinstance(model, DistributedModelParallel) else model


class HashModule(Protocol):
    """What a checkpoint (and a publisher) uses of a sharded hash module.

    A :class:`~recsdk.sharding.HashModule` or
    :class:`~recsdk.sharding.ShardedHashEmbeddingCollection`: recsdk's public accessors
    (:class:`~recsdk.sharding.HostShardedModule`) and TorchRec's ``module_sharding_plan`` and
    ``fused_optimizer``.
    """

    @property
    def host_group(self) -> dist.ProcessGroup: ...
    @property
    def id_tables(self) -> dict[str, IdTable]: ...
    @property
    def table_configs(self) -> dict[str, BaseEmbeddingConfig]: ...
    @property
    def ledger(self) -> RowLedger: ...
    @property
    def module_sharding_plan(self) -> Mapping[str, ParameterSharding]: ...
    @property
    def fused_optimizer(self) -> KeyedOptimizer: ...
    def table_views(self) -> dict[str, TableViews]: ...
    def staging_views(self, table: str) -> TableViews: ...
    def parameter_key(self, table: str) -> str: ...
    def kernel_rows(self, table: str) -> int: ...
    def release_finished_pins(self) -> None: ...
    # publishing (recsdk.sharding.Publisher)
    def read_rows(self, table: str, rows: torch.Tensor) -> torch.Tensor: ...
    def track_changes(self) -> None: ...
    def change_snapshots(self, *, full: bool) -> dict[str, ChangeSnapshot]: ...
    def commit_changes(self, snapshots: dict[str, ChangeSnapshot], token: str) -> None: ...


def hash_modules(model: nn.Module, what: str = "checkpoints") -> dict[str, HashModule]:
    """Sharded hash modules by FQN (as in ``model.state_dict()`` keys); ``what`` names the caller
    in the error (``"checkpoints"``, ``"publications"``).

    Raises:
        TypeError: the model holds an unsharded ``HashEmbeddingBagCollection`` or
            ``HashEmbeddingCollection``.
    """
    for fqn, module in root(model).named_modules():
        unsharded = isinstance(module, HashEmbeddingBagCollection | HashEmbeddingCollection)
        if unsharded and not isinstance(module, HostShardedModule):
            raise TypeError(
                f"module {fqn or '<root>'!r} is an unsharded {type(module).__name__}: {what} cover hash "
                "tables sharded by DistributedModelParallel with recsdk's sharders "
                "(get_default_hybrid_sharders); shard the model first"
            )
    # Every HostShardedModule is a TorchRec sharded module: it has module_sharding_plan and fused_optimizer.
    return cast(dict[str, HashModule], sharded_hash_modules(model))


def host_group(modules: Mapping[str, HashModule]) -> dist.ProcessGroup | None:
    """The host (gloo) group of the first hash module; None without hash modules (the default group)."""
    for module in modules.values():
        return module.host_group
    return None


def weight_key(fqn: str, module: HashModule, table: str) -> str:
    """The table's weight key in ``model.state_dict()``."""
    key = module.parameter_key(table)
    return f"{fqn}.{key}" if fqn else key


def hash_weight_keys(modules: Mapping[str, HashModule]) -> set[str]:
    """The hash tables' weight keys in ``model.state_dict()`` (saved by shard, not as ``model/`` keys)."""
    return {weight_key(fqn, m, name) for fqn, m in modules.items() for name in m.module_sharding_plan}


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
