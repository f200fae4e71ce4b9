"""The shardings recsdk builds: host row-wise and table-wise for hash tables, gloo row-wise.

* :class:`HostRwPooledEmbeddingSharding`: row-wise; the input dist buckets raw ids by
  :func:`~recsdk.sharding.owner` and exchanges them over the host (gloo) group.
* :class:`HostTwPooledEmbeddingSharding`: table-wise; the id all-to-all runs over the host group.
* :class:`GlooRwPooledEmbeddingSharding`: TorchRec's row-wise, with the all-to-all pooled output
  dist on gloo (plain EBCs on CPU, and the host row-wise above).
* :class:`HostRwSequenceEmbeddingSharding`, :class:`HostTwSequenceEmbeddingSharding`: the same
  host input dists for unpooled tables, with TorchRec's sequence output dists.

Each overrides TorchRec's ``create_input_dist`` or ``create_output_dist`` hooks (the host
table-wise both) and keeps the rest of TorchRec's sharding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.embeddingbag import replace_placement_with_meta_device
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist, RwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sequence_sharding import TwSequenceEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import BaseTwEmbeddingSharding, TwPooledEmbeddingSharding
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType

from recsdk.sharding import _torchrec_compat as compat
from recsdk.sharding.distribution.input_dist import (
    HostTwSparseFeaturesDist,
    OwnerSequenceFeaturesDist,
    OwnerSparseFeaturesDist,
)
from recsdk.sharding.distribution.output_dist import (
    AllToAllPooledEmbeddingDist,
    FlagCarryingTwPooledEmbeddingDist,
    is_gloo,
)

__all__ = [
    "HOST_SHARDING_TYPES",
    "GlooRwPooledEmbeddingSharding",
    "HostRwPooledEmbeddingSharding",
    "HostRwSequenceEmbeddingSharding",
    "HostTwPooledEmbeddingSharding",
    "HostTwSequenceEmbeddingSharding",
    "check_host_sharding_types",
    "create_host_sharding",
]

HOST_SHARDING_TYPES = (ShardingType.ROW_WISE.value, ShardingType.TABLE_WISE.value)
"""The sharding types of hash tables: the id work is on the host for both."""


class GlooRwPooledEmbeddingSharding(RwPooledEmbeddingSharding):
    """TorchRec's row-wise pooled sharding, with :class:`AllToAllPooledEmbeddingDist` on gloo.

    On any other backend (nccl, hccl) the output dist is TorchRec's reduce-scatter.

    Args:
        as TorchRec's ``RwPooledEmbeddingSharding``.
    """

    def create_output_dist(self, device: torch.device | None = None) -> RwPooledEmbeddingDist:
        pg = compat.sharding_group(self)
        if pg is not None and is_gloo(pg):
            return AllToAllPooledEmbeddingDist(
                pg, qcomm_codecs_registry=self.qcomm_codecs_registry, embedding_dims=self.embedding_dims()
            )
        return super().create_output_dist(device)


class _HostGroupSharding:
    """Adds ``host_pg``, the host (gloo) group for the id all-to-alls, to a TorchRec sharding."""

    def __init__(
        self,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, Any] | None = None,
        *,
        host_pg: dist.ProcessGroup,
    ) -> None:
        super().__init__(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)  # type: ignore[call-arg]
        self._host_pg = host_pg


class HostRwPooledEmbeddingSharding(_HostGroupSharding, GlooRwPooledEmbeddingSharding):
    """Row-wise sharding whose input dist buckets raw ids by owner over the host group.

    The pooled output dist is :class:`GlooRwPooledEmbeddingSharding`'s: an all-to-all on gloo,
    TorchRec's reduce-scatter otherwise.

    Args:
        sharding_infos, env, device, qcomm_codecs_registry: as TorchRec's
            ``RwPooledEmbeddingSharding``.
        host_pg (dist.ProcessGroup): the host (gloo) group for the id all-to-alls.
    """

    def create_input_dist(self, device: torch.device | None = None) -> OwnerSparseFeaturesDist:
        return OwnerSparseFeaturesDist(self._host_pg, compat.num_features(self))


class _HostTwSharding(_HostGroupSharding, BaseTwEmbeddingSharding):
    """Table-wise, pooled or not: the id all-to-all sends every id of a table to the table's rank
    over the host group."""

    def create_input_dist(self, device: torch.device | None = None) -> HostTwSparseFeaturesDist:
        return HostTwSparseFeaturesDist(self._host_pg, self.features_per_rank())


class HostTwPooledEmbeddingSharding(_HostTwSharding, TwPooledEmbeddingSharding):
    """Table-wise sharding whose id all-to-all runs over the host group; its output dist is
    TorchRec's, able to carry the host stage's failure flag (:class:`FlagCarryingTwPooledEmbeddingDist`).

    Args:
        sharding_infos, env, device, qcomm_codecs_registry: as TorchRec's
            ``TwPooledEmbeddingSharding``.
        host_pg (dist.ProcessGroup): the host (gloo) group for the id all-to-alls.
    """

    def create_output_dist(self, device: torch.device | None = None) -> FlagCarryingTwPooledEmbeddingDist:
        return FlagCarryingTwPooledEmbeddingDist(**compat.tw_output_dist_kwargs(self, device))


class HostRwSequenceEmbeddingSharding(_HostGroupSharding, RwSequenceEmbeddingSharding):
    """Row-wise sharding of unpooled tables whose input dist buckets raw ids by owner over the
    host group; TorchRec's sequence output dist returns one embedding per id in input order.

    Args:
        sharding_infos, env, device, qcomm_codecs_registry: as TorchRec's
            ``RwSequenceEmbeddingSharding``.
        host_pg (dist.ProcessGroup): the host (gloo) group for the id all-to-alls.
    """

    def create_input_dist(self, device: torch.device | None = None) -> OwnerSequenceFeaturesDist:
        return OwnerSequenceFeaturesDist(
            self._host_pg, compat.num_features(self), device or compat.sharding_device(self)
        )


class HostTwSequenceEmbeddingSharding(_HostTwSharding, TwSequenceEmbeddingSharding):
    """Table-wise sharding of unpooled tables whose id all-to-all runs over the host group.

    Args:
        sharding_infos, env, device, qcomm_codecs_registry: as TorchRec's
            ``TwSequenceEmbeddingSharding``.
        host_pg (dist.ProcessGroup): the host (gloo) group for the id all-to-alls.
    """


def check_host_sharding_types(plan: Mapping[str, ParameterSharding], module: str) -> None:
    """Raise unless every table of ``plan`` is row-wise or table-wise.

    Raises:
        ValueError: names the first table with another sharding type and the supported ones.
    """
    for name, ps in plan.items():
        if ps.sharding_type not in HOST_SHARDING_TYPES:
            raise ValueError(
                f"table {name!r}: sharding type {ps.sharding_type!r} is not supported for {module}; "
                f"supported: {list(HOST_SHARDING_TYPES)}"
            )


_HOST_SHARDINGS: dict[tuple[bool, str], Any] = {
    (True, ShardingType.ROW_WISE.value): HostRwPooledEmbeddingSharding,
    (True, ShardingType.TABLE_WISE.value): HostTwPooledEmbeddingSharding,
    (False, ShardingType.ROW_WISE.value): HostRwSequenceEmbeddingSharding,
    (False, ShardingType.TABLE_WISE.value): HostTwSequenceEmbeddingSharding,
}


def create_host_sharding(
    sharding_infos: list[EmbeddingShardingInfo],
    env: ShardingEnv,
    device: torch.device | None,
    qcomm_codecs_registry: dict[str, Any] | None,
    host_pg: dist.ProcessGroup,
    *,
    pooled: bool,
) -> EmbeddingSharding:
    """The host sharding of a group of hash tables of one sharding type (row- or table-wise).

    Args:
        sharding_infos, env, device, qcomm_codecs_registry: as TorchRec's sharding factories.
        host_pg (dist.ProcessGroup): the host (gloo) group for the id all-to-alls.
        pooled (bool): bag tables (pooled output) or unpooled tables (one embedding per id).

    Raises:
        ValueError: a sharding type other than row-wise or table-wise.
    """
    check_host_sharding_types({i.embedding_config.name: i.param_sharding for i in sharding_infos}, "hash tables")
    if pooled and device is not None and device.type == "meta":  # as TorchRec's EBC (its EC does not)
        replace_placement_with_meta_device(sharding_infos)
    kind = _HOST_SHARDINGS[(pooled, sharding_infos[0].param_sharding.sharding_type)]
    return kind(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry, host_pg=host_pg)  # type: ignore[no-any-return]
