"""What checkpoints, exports and publications read off a model: its sharded hash modules.

:class:`HashModule` is what a writer uses of a sharded hash module (a
:class:`~recsdk.sharding.HostShardedModule` with TorchRec's ``module_sharding_plan`` and
``fused_optimizer``); :func:`hash_modules` finds them in a model (refusing an unsharded one), and
:func:`hash_weight_keys` names their tables' weights in ``model.state_dict()``, which a writer
saves by id rather than as tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ParameterSharding
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.optim.keyed import KeyedOptimizer

from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingCollection, IdTable
from recsdk.embedding.change_tracker import ChangeSnapshot
from recsdk.sharding.host.row_ledger import RowLedger
from recsdk.sharding.host_sharded_module import HostShardedModule, sharded_hash_modules
from recsdk.sharding.rows.tbe_views import TableViews

__all__ = ["HashModule", "hash_modules", "hash_weight_keys", "host_group", "root", "weight_key"]


def root(model: nn.Module) -> nn.Module:
    """The module ``DistributedModelParallel`` wraps (state-dict keys are relative to it), else ``model``."""
    return model.module if isinstance(model, DistributedModelParallel) else model


class HashModule(Protocol):
    """What a checkpoint, an export or a publisher uses of a sharded hash module.

    A :class:`~recsdk.sharding.ShardedHashEmbeddingBagCollection` or
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
