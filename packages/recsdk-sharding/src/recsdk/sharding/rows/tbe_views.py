"""The fused kernel's per-table views: where a shard's rows and optimizer state live.

TorchRec's fused lookups hold one FBGEMM table-batched kernel per group of tables; each kernel
stores every table's rows in one flat buffer (and its optimizer state likewise). The id
machinery addresses rows per table, so it needs per-table views into those buffers: the
weight ``[rows, dim]`` and each per-row optimizer state (Adagrad's ``[rows, dim]``
momentum, RowWiseAdagrad's ``[rows]``). Views, not copies: writing them writes the kernel.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbedding, BatchedFusedEmbeddingBag
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from recsdk.embedding import init_rows_

__all__ = ["TableViews", "fused_table_views", "init_all_rows_", "reset_rows_"]


class TableViews(NamedTuple):
    """One local table shard in the fused kernel.

    Attributes:
        weight (torch.Tensor): ``[rows, dim]`` view of the kernel's weights.
        states (list[torch.Tensor]): per-row optimizer state views, ``[rows, ...]`` each, in the
            kernel's order (empty for SGD).
    """

    weight: torch.Tensor
    states: list[torch.Tensor]


def fused_table_views(lookups: Iterable[torch.nn.Module]) -> dict[str, TableViews]:
    """Per table name, the weight and optimizer-state views of every fused kernel under ``lookups``.

    Args:
        lookups (Iterable[nn.Module]): a sharded module's lookups (TorchRec's grouped lookups).

    Returns:
        dict[str, TableViews]: table name -> its views on this rank.

    Example::

        views = fused_table_views(compat.fused_lookups(sharded_ebc))  # as HostShards builds them
        weight, states = views["user"]
    """
    views: dict[str, TableViews] = {}
    for lookup in lookups:
        for module in lookup.modules():
            if not isinstance(module, BatchedFusedEmbeddingBag | BatchedFusedEmbedding):
                continue
            tbe = module.emb_module
            weights = tbe.split_embedding_weights()
            states = tbe.split_optimizer_states()
            for i, table in enumerate(module.config.embedding_tables):
                views[table.name] = TableViews(weights[i], list(states[i]) if i < len(states) else [])
    return views


def reset_rows_(views: TableViews, rows: torch.Tensor, config: BaseEmbeddingConfig) -> None:
    """Give ``rows`` fresh ``init_fn`` embeddings and zeroed optimizer state, in place.

    What a row reassigned to a new id needs before its first lookup.

    Args:
        views (TableViews): the table's views.
        rows (torch.Tensor): int64 row indices.
        config (BaseEmbeddingConfig): the table's config (its ``init_fn``).
    """
    with torch.no_grad():
        init_rows_(views.weight, rows.to(views.weight.device), config)
        for state in views.states:
            state[rows.to(state.device)] = 0


def init_all_rows_(views: Mapping[str, TableViews], configs: Mapping[str, BaseEmbeddingConfig]) -> None:
    """Initialise every row of each table in ``views`` with its config's ``init_fn``, in place.

    The fused kernel initialises uniformly from ``weight_init_min/max`` and ignores ``init_fn``;
    a hash table hands rows to ids as they arrive, so every row must start as ``init_fn`` makes it.
    """
    with torch.no_grad():
        for name, view in views.items():
            init_rows_(view.weight, torch.arange(view.weight.shape[0], device=view.weight.device), configs[name])
