"""``HashEmbeddingBagCollection``: TorchRec's ``EmbeddingBagCollection`` on raw int64 ids."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    process_pooled_embeddings,
    reorder_inverse_indices,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from recsdk.embedding.config import HashEmbeddingBagConfig
from recsdk.embedding.hash_tables import (
    HashIdTablesMixin,
    OptimizerAttachment,
    check_tables,
    click_tables,
    jagged_per_feature,
)

__all__ = ["HashEmbeddingBagCollection", "OptimizerAttachment"]


class HashEmbeddingBagCollection(HashIdTablesMixin, EmbeddingBagCollection):
    """An ``EmbeddingBagCollection`` whose features are raw int64 ids, mapped to rows by id tables.

    A drop-in for ``torchrec.EmbeddingBagCollection``: same parameters
    (``embedding_bags.<table>.weight``, ``[num_embeddings, dim]``), same ``forward(kjt) ->
    KeyedTensor`` layout, same ``embedding_bag_configs()``, ``is_weighted()`` and ``device``. The
    difference is the input: KJT values are any int64 (or int32) ids, not row indices. Each table
    has an :class:`~recsdk.embedding.IdTable` (capacity ``num_embeddings``, the config's admission
    and eviction, named after the table) shared by all its features.

    * ``train()`` mode maps ids with ``find_or_insert``: new ids get rows, admission counts them,
      eviction frees rows when a table is full. Rows handed to a new id after eviction are
      re-initialised with the table's ``init_fn`` in the same forward, before the lookup; call
      :meth:`attach_optimizer` so the optimizer's state of those rows is reset too.
    * ``eval()`` mode maps ids with ``find``: no id table state changes, unknown ids look up as zeros.
    * Ids without a row (not admitted yet, or unknown in eval) contribute zeros and get no gradient.
      For MEAN pooling they still count in the bag's length (the divisor), as TorchRec's row-wise
      sharding does with ids it drops. With every id present, SUM and MEAN pooling run the same
      ``embedding_bag`` call as ``EmbeddingBagCollection`` (bit-identical results); weighted MEAN
      divides the weighted sum by the bag length.

    The id tables are not modules or parameters, so the planner and sharders see only the weights,
    and they are not in :meth:`state_dict`: save them with :meth:`id_table_state_dict` and restore
    them with :meth:`load_id_table_state_dict`. With ``device="meta"`` the id tables are meta
    placeholders; the first forward on real weights replaces them with empty tables.

    Args:
        tables (list[HashEmbeddingBagConfig]): the tables.
        device (torch.device | str | None): where the weights live (``"meta"`` allocates nothing).
        is_weighted (bool): whether input KJTs carry per-value weights.
        id_table_device (torch.device | str | None): where the id tables live; defaults to ``device``.

    Example::

        ebc = HashEmbeddingBagCollection(
            tables=[HashEmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=1000,
                                           feature_names=["user_id"], eviction=LRUEviction())],
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["user_id"], values=torch.tensor([2**62, -5, 7]), lengths=torch.tensor([2, 1]))
        ebc(kjt).values().shape  # torch.Size([2, 8])
    """

    def __init__(
        self,
        tables: list[HashEmbeddingBagConfig],
        *,
        device: torch.device | str | None = None,
        is_weighted: bool = False,
        id_table_device: torch.device | str | None = None,
    ) -> None:
        check_tables(tables, HashEmbeddingBagConfig, module="HashEmbeddingBagCollection")
        if not isinstance(is_weighted, bool):
            raise TypeError(f"HashEmbeddingBagCollection: is_weighted must be a bool, got {is_weighted!r}")
        clicking = click_tables(tables)
        if is_weighted and clicking:
            raise ValueError(
                f"HashEmbeddingBagCollection: table(s) {clicking} score clicks (ShowClickScore with "
                "beta > 0), which come as the KJT's per-id weights, but a weighted collection pools with its "
                "weights; use is_weighted=False, or beta=0 (shows only)"
            )
        super().__init__(tables=tables, is_weighted=is_weighted, device=torch.device(device) if device else None)
        self._init_hash_tables(tables, id_table_device, module="HashEmbeddingBagCollection")

    def _hash_weight(self, name: str) -> torch.Tensor:
        return self.embedding_bags[name].weight

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool the embeddings of each feature's ids.

        Args:
            features (KeyedJaggedTensor): keys exactly the configured feature names (any order),
                int64/int32 ids as values, per-value weights when ``is_weighted``; in training,
                each id's clicks as its weight for tables with a show/click score that reads
                clicks (``recsdk.data.Batch.with_clicks()``).

        Returns:
            KeyedTensor: keys, order and dims as ``EmbeddingBagCollection`` (``[B, sum(dims)]`` values).
        """
        features = self._hash_tables.check_input(features, is_weighted=self._is_weighted, training=self.training)
        flat_feature_names = [n for names in self._feature_names for n in names]
        inverse_indices = reorder_inverse_indices(
            inverse_indices=features.inverse_indices_or_none(),
            feature_names=flat_feature_names,
        )
        feature_dict = jagged_per_feature(features)
        pooled: list[torch.Tensor] = []
        for cfg, bag in zip(self._embedding_bag_configs, self.embedding_bags.values(), strict=True):
            assert isinstance(cfg, HashEmbeddingBagConfig)
            weight = bag.weight
            jts = [feature_dict[n] for n in cfg.feature_names]
            rows, all_present = self._hash_tables.map_ids(
                cfg.name,
                weight,
                [jt.values() for jt in jts],
                training=self.training,
                clicks=[jt.weights_or_none() for jt in jts],
            )
            for jt, feature_rows, feature_all_present in zip(jts, rows, all_present, strict=True):
                pooled.append(self._pool(cfg, weight, jt, feature_rows, feature_all_present).float())
        return KeyedTensor(
            keys=self._embedding_names,
            values=process_pooled_embeddings(pooled_embeddings=pooled, inverse_indices=inverse_indices),
            length_per_key=self._lengths_per_embedding,
        )

    # ------------------------------------------------------------------ internals

    def _pool(
        self, cfg: HashEmbeddingBagConfig, weight: torch.Tensor, jt: JaggedTensor, rows: torch.Tensor, all_present: bool
    ) -> torch.Tensor:
        offsets = jt.offsets().to(torch.int64)
        psw = jt.weights() if self._is_weighted else None
        mean = cfg.pooling == PoolingType.MEAN
        if all_present:
            if mean and psw is None:
                return F.embedding_bag(rows, weight, offsets, mode="mean", include_last_offset=True)
            out = F.embedding_bag(rows, weight, offsets, mode="sum", include_last_offset=True, per_sample_weights=psw)
        else:
            present = rows >= 0
            lengths = offsets.diff()
            bag = torch.repeat_interleave(
                torch.arange(lengths.numel(), device=rows.device), lengths, output_size=rows.numel()
            )
            kept = torch.bincount(bag[present], minlength=lengths.numel())
            kept_offsets = torch.cat([offsets.new_zeros(1), kept.cumsum(0)])
            out = F.embedding_bag(
                rows[present],
                weight,
                kept_offsets,
                mode="sum",
                include_last_offset=True,
                per_sample_weights=None if psw is None else psw[present],
            )
        if mean:
            out = out / offsets.diff().clamp(min=1).unsqueeze(1).to(out.dtype)
        return out
