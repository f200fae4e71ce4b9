"""``MeanPooling``: a sharded hash bag collection's MEAN tables, pooled as the unsharded module pools them.

The fused kernels pool these tables by SUM; the mean divides each bag by its length in the batch
as this rank received it (clamped to 1), on this rank, once the output dist is done. Ids without
a row (not admitted yet, or unknown in eval), which the host stage drops from their bags, still
count, as in the unsharded ``HashEmbeddingBagCollection``; so every plan gives the same means
(FBGEMM's MEAN kernel, which a table-wise table would get, divides by the ids it is given), and
an empty batch gives 0 rows (TorchRec's own row-wise mean divisor, which this replaces, cannot be
shaped for 0 samples).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import torch
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

__all__ = ["MeanPooling"]


class MeanPooling:
    """The MEAN tables of one sharded bag collection.

    Args:
        configs (Iterable[EmbeddingBagConfig]): the collection's tables, as the user gave them.

    Example::

        mean = MeanPooling(configs)
        mean.pool_by_sum(infos)                   # before TorchRec builds the kernels
        lengths = mean.bag_lengths(features)      # this rank's batch, as received
        pooled = mean.apply(pooled_sums, lengths) # after the output dist
    """

    def __init__(self, configs: Iterable[EmbeddingBagConfig]) -> None:
        configs = list(configs)
        self._tables = {c.name for c in configs if c.pooling == PoolingType.MEAN}
        self._features = [f for c in configs if c.name in self._tables for f in c.feature_names]

    @property
    def active(self) -> bool:
        """Whether the collection has a MEAN table."""
        return bool(self._tables)

    def pool_by_sum(self, infos: Mapping[str, list[EmbeddingShardingInfo]]) -> None:
        """Give the MEAN tables' kernels SUM pooling (in place, before the kernels are built)."""
        for group in infos.values():
            for info in group:
                if info.embedding_config.name in self._tables:
                    info.embedding_config = dataclasses.replace(info.embedding_config, pooling=PoolingType.SUM)

    def bag_lengths(self, features: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        """Per MEAN feature, its bags' lengths ``[B]`` in ``features`` (a checked batch, one stride)."""
        if not self._features:
            return {}
        keys = features.keys()
        lengths = features.lengths().view(len(keys), features.stride())  # explicit: B may be 0
        return {f: lengths[keys.index(f)] for f in self._features}

    def apply(self, pooled: KeyedTensor, lengths: Mapping[str, torch.Tensor]) -> KeyedTensor:
        """``pooled`` (sums, ``[B, D]``) with each MEAN feature's columns divided by its bags' lengths."""
        if not lengths:
            return pooled
        values = pooled.values()
        batch = values.shape[0]
        blocks = []
        for key, dim in zip(pooled.keys(), pooled.length_per_key(), strict=True):
            bag = lengths.get(key)
            if bag is None:
                blocks.append(values.new_ones(batch, 1).expand(batch, dim))
            else:
                count = bag.to(device=values.device, dtype=values.dtype).clamp(min=1)
                blocks.append(count.unsqueeze(1).expand(batch, dim))
        return KeyedTensor(
            keys=pooled.keys(),
            values=values / torch.cat(blocks, dim=1),
            length_per_key=pooled.length_per_key(),
            key_dim=1,
        )
