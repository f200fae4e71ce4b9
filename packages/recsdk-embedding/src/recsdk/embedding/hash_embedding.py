"""``HashEmbeddingCollection``: TorchRec's ``EmbeddingCollection`` (sequence embeddings) on raw int64 ids."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from recsdk.embedding.config import HashEmbeddingConfig
from recsdk.embedding.hash_tables import HashIdTablesMixin, check_tables, jagged_per_feature

__all__ = ["HashEmbeddingCollection"]

_MODULE = "HashEmbeddingCollection"


class HashEmbeddingCollection(HashIdTablesMixin, EmbeddingCollection):
    """An ``EmbeddingCollection`` whose features are raw int64 ids, mapped to rows by id tables.

    A drop-in for ``torchrec.EmbeddingCollection``: same parameters (``embeddings.<table>.weight``,
    ``[num_embeddings, dim]``; all tables of one dim, as TorchRec requires), same
    ``forward(kjt) -> dict[str, JaggedTensor]``, same ``embedding_configs()``, ``need_indices()``,
    ``embedding_dim()`` and ``device``. The difference is the input: KJT values are any int64 (or
    int32) ids, not row indices. Each table has an :class:`~recsdk.embedding.IdTable` (capacity
    ``num_embeddings``, the config's admission and eviction, named after the table) shared by all
    its features, e.g. a history feature and a candidate feature over one item table.

    * ``train()`` mode maps ids with ``find_or_insert`` (the features of a table in one call):
      new ids get rows, admission counts them, eviction frees rows when a table is full. Rows
      handed to a new id after eviction are re-initialised with the table's ``init_fn`` in the same
      forward, before the lookup; call :meth:`attach_optimizer` so the optimizer's state of those
      rows is reset too.
    * ``eval()`` mode maps ids with ``find``: no id table state changes.
    * An id without a row (not admitted yet, or unknown in eval) gets a zero embedding and no
      gradient. With every id present the lookup is the table's ``nn.Embedding`` call, as in
      ``EmbeddingCollection`` (bit-identical results and gradients).

    The id tables are not modules or parameters, so the planner and sharders see only the weights,
    and they are not in :meth:`state_dict`: save them with :meth:`id_table_state_dict` and restore
    them with :meth:`load_id_table_state_dict`. With ``device="meta"`` the weights and the id
    tables are placeholders; the first forward on real weights replaces the id tables with empty
    ones on the weights' device (or ``id_table_device``).

    Shapes: for a KJT of ``F`` features and batch size ``B``, ``out[f]`` is a ``JaggedTensor``
    with values ``[sum(lengths[f]), dim]`` (one embedding per id, in input order), the input's
    ``[B]`` lengths and ``[B + 1]`` offsets.

    Args:
        tables (list[HashEmbeddingConfig]): the tables.
        device (torch.device | str | None): where the weights live (``"meta"`` allocates nothing).
        need_indices (bool): also return each feature's raw ids, as the output's ``weights``.
        id_table_device (torch.device | str | None): where the id tables live; defaults to ``device``.

    Example::

        ec = HashEmbeddingCollection(
            tables=[HashEmbeddingConfig(name="item", embedding_dim=8, num_embeddings=1000,
                                        feature_names=["history", "candidate"], eviction=LRUEviction())],
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["history", "candidate"], values=torch.tensor([2**62, -5, 7, 2**62]),
            lengths=torch.tensor([2, 1, 1, 0]))
        out = ec(kjt)
        out["history"].values().shape  # torch.Size([3, 8])
        out["history"].lengths()  # tensor([2, 1])
    """

    def __init__(
        self,
        tables: list[HashEmbeddingConfig],
        *,
        device: torch.device | str | None = None,
        need_indices: bool = False,
        id_table_device: torch.device | str | None = None,
    ) -> None:
        check_tables(tables, HashEmbeddingConfig, module=_MODULE)
        if not isinstance(need_indices, bool):
            raise TypeError(f"{_MODULE}: need_indices must be a bool, got {need_indices!r}")
        super().__init__(tables=tables, device=torch.device(device) if device else None, need_indices=need_indices)
        self._init_hash_tables(tables, id_table_device, module=_MODULE)

    def _hash_weight(self, name: str) -> torch.Tensor:
        return self.embeddings[name].weight

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """Look up one embedding per id.

        Args:
            features (KeyedJaggedTensor): keys exactly the configured feature names (any order),
                int64/int32 ids as values; per-value weights are ignored, except in training by
                tables with a show/click score that reads clicks: each id's clicks
                (``recsdk.data.Batch.with_clicks()``).

        Returns:
            dict[str, JaggedTensor]: embedding name (the feature name, as ``EmbeddingCollection``
            names it) -> values ``[num_ids, dim]`` (float32), the feature's lengths and offsets,
            and its raw ids as ``weights`` when ``need_indices``.
        """
        features = self._hash_tables.check_input(features, is_weighted=False, training=self.training)
        jt_dict = jagged_per_feature(features)
        out: dict[str, JaggedTensor] = {}
        for cfg, emb, embedding_names in zip(
            self._embedding_configs, self.embeddings.values(), self._embedding_names_by_table, strict=True
        ):
            assert isinstance(emb, nn.Embedding)
            jts = [jt_dict[n] for n in cfg.feature_names]
            rows, all_present = self._hash_tables.map_ids(
                cfg.name,
                emb.weight,
                [jt.values() for jt in jts],
                training=self.training,
                clicks=[jt.weights_or_none() for jt in jts],
            )
            for name, jt, feature_rows, feature_all_present in zip(
                embedding_names, jts, rows, all_present, strict=True
            ):
                out[name] = JaggedTensor(
                    values=self._lookup(emb, feature_rows, feature_all_present),
                    lengths=jt.lengths(),
                    offsets=jt.offsets(),
                    weights=jt.values() if self._need_indices else None,
                )
        return out

    @staticmethod
    def _lookup(emb: nn.Embedding, rows: torch.Tensor, all_present: bool) -> torch.Tensor:
        """``[len(rows), dim]`` embeddings; rows ``-1`` (no row) give zeros and no gradient."""
        if all_present:
            return emb(rows).float()
        kept = (rows >= 0).nonzero().squeeze(1)
        found = emb(rows[kept]).float()
        return found.new_zeros(rows.numel(), found.shape[1]).index_copy(0, kept, found)
