"""``HashEmbeddingBagCollection``: TorchRec's ``EmbeddingBagCollection`` on raw int64 ids."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    process_pooled_embeddings,
    reorder_inverse_indices,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from recsdk.embedding.config import HashEmbeddingBagConfig
from recsdk.embedding.id_table import IdTable
from recsdk.embedding.input_checks import check_features
from recsdk.embedding.row_init import init_rows_, reset_optimizer_rows_

__all__ = ["HashEmbeddingBagCollection", "OptimizerAttachment"]


class OptimizerAttachment:
    """Handle returned by :meth:`HashEmbeddingBagCollection.attach_optimizer`; ``remove()`` detaches."""

    def __init__(
        self,
        hook: RemovableHandle,
        pending: dict[str, list[torch.Tensor]],
        listeners: list[dict[str, list[torch.Tensor]]],
    ) -> None:
        self._hook = hook
        self._pending = pending
        self._listeners = listeners

    def remove(self) -> None:
        """Stop resetting the optimizer's state of reassigned rows."""
        self._hook.remove()
        self._listeners[:] = [p for p in self._listeners if p is not self._pending]


class HashEmbeddingBagCollection(EmbeddingBagCollection):
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
        if not isinstance(tables, list) or not tables:
            raise ValueError(f"HashEmbeddingBagCollection: tables must be a non-empty list, got {tables!r}")
        for i, cfg in enumerate(tables):
            if not isinstance(cfg, HashEmbeddingBagConfig):
                raise TypeError(
                    f"HashEmbeddingBagCollection: tables[{i}] (name {getattr(cfg, 'name', '?')!r}) must be a "
                    f"HashEmbeddingBagConfig, got {type(cfg).__name__}"
                )
        if not isinstance(is_weighted, bool):
            raise TypeError(f"HashEmbeddingBagCollection: is_weighted must be a bool, got {is_weighted!r}")
        super().__init__(tables=tables, is_weighted=is_weighted, device=torch.device(device) if device else None)
        self._id_table_device = torch.device(id_table_device) if id_table_device is not None else self._device
        self._id_tables: dict[str, IdTable] = {
            cfg.name: self._new_id_table(cfg, self._id_table_device) for cfg in tables
        }
        self._all_features: list[str] = list(dict.fromkeys(n for cfg in tables for n in cfg.feature_names))
        self._optimizer_listeners: list[dict[str, list[torch.Tensor]]] = []

    # ------------------------------------------------------------------ public API

    @property
    def id_tables(self) -> dict[str, IdTable]:
        """Table name -> its :class:`~recsdk.embedding.IdTable`."""
        return self._id_tables

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per-table id table statistics (see :meth:`IdTable.stats`)."""
        return {name: table.stats() for name, table in self._id_tables.items()}

    def id_table_state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Table name -> :meth:`IdTable.state_dict`; save it beside :meth:`state_dict`."""
        return {name: table.state_dict() for name, table in self._id_tables.items()}

    def load_id_table_state_dict(self, state_dict: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore the id tables from :meth:`id_table_state_dict` (every table must be present)."""
        missing = sorted(set(self._id_tables) - set(state_dict))
        extra = sorted(set(state_dict) - set(self._id_tables))
        if missing or extra:
            raise ValueError(
                f"HashEmbeddingBagCollection.load_id_table_state_dict: tables missing {missing}, unexpected {extra}"
            )
        for name, table in list(self._id_tables.items()):
            if table.device.type == "meta":
                cfg = self._config(name)
                table = self._id_tables[name] = self._new_id_table(cfg, self._real_device())
            table.load_state_dict(state_dict[name])

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> OptimizerAttachment:
        """Reset ``optimizer``'s state of reassigned rows before each of its steps.

        Rows that forward handed to new ids since the optimizer's last step get their per-row
        state reset with :func:`~recsdk.embedding.reset_optimizer_rows_` (Adagrad's ``sum``,
        momentum buffers, Adam moments), so the next update of such a row equals a fresh row's.

        Args:
            optimizer (torch.optim.Optimizer): a plain torch optimizer over this module's weights.

        Returns:
            OptimizerAttachment: ``handle.remove()`` detaches it.
        """
        pending: dict[str, list[torch.Tensor]] = {}
        self._optimizer_listeners.append(pending)

        def reset(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            for name, chunks in list(pending.items()):
                rows = torch.cat(chunks).unique()
                reset_optimizer_rows_(opt, self.embedding_bags[name].weight, rows)
            pending.clear()

        return OptimizerAttachment(optimizer.register_step_pre_hook(reset), pending, self._optimizer_listeners)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool the embeddings of each feature's ids.

        Args:
            features (KeyedJaggedTensor): keys exactly the configured feature names (any order),
                int64/int32 ids as values, per-value weights when ``is_weighted``.

        Returns:
            KeyedTensor: keys, order and dims as ``EmbeddingBagCollection`` (``[B, sum(dims)]`` values).
        """
        self._check_input(features)
        flat_feature_names = [n for names in self._feature_names for n in names]
        inverse_indices = reorder_inverse_indices(
            inverse_indices=features.inverse_indices_or_none(),
            feature_names=flat_feature_names,
        )
        feature_dict = features.to_dict()
        pooled: list[torch.Tensor] = []
        for cfg, bag in zip(self._embedding_bag_configs, self.embedding_bags.values(), strict=True):
            assert isinstance(cfg, HashEmbeddingBagConfig)
            weight = bag.weight
            jts = [feature_dict[n] for n in cfg.feature_names]
            rows, all_present = self._map_ids(cfg, weight, [jt.values() for jt in jts])
            for jt, feature_rows, feature_all_present in zip(jts, rows, all_present, strict=True):
                pooled.append(self._pool(cfg, weight, jt, feature_rows, feature_all_present).float())
        return KeyedTensor(
            keys=self._embedding_names,
            values=process_pooled_embeddings(pooled_embeddings=pooled, inverse_indices=inverse_indices),
            length_per_key=self._lengths_per_embedding,
        )

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _new_id_table(cfg: HashEmbeddingBagConfig, device: torch.device) -> IdTable:
        return IdTable(cfg.num_embeddings, device=device, admission=cfg.admission, eviction=cfg.eviction, name=cfg.name)

    def _config(self, name: str) -> HashEmbeddingBagConfig:
        cfg = next(c for c in self._embedding_bag_configs if c.name == name)
        assert isinstance(cfg, HashEmbeddingBagConfig)
        return cfg

    def _real_device(self) -> torch.device:
        if self._id_table_device.type != "meta":
            return self._id_table_device
        return next(iter(self.embedding_bags.values())).weight.device

    def _check_input(self, features: KeyedJaggedTensor) -> None:
        """Reject a bad batch before any id table changes (keys, dtypes, weights, lengths).

        The same checks, with the same messages, as the sharded module's ``input_dist``.
        """
        check_features(features, self._all_features, module="HashEmbeddingBagCollection", is_weighted=self._is_weighted)

    def _map_ids(
        self, cfg: HashEmbeddingBagConfig, weight: torch.Tensor, values: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[bool]]:
        """Rows (on the weight's device) of each feature's ids, and whether each feature has a row for all its ids.

        Reassigned rows are re-initialised. The "all present" flags are computed on the id table's
        device (the host, usually) before the rows move, in one transfer per table, so pooling never
        waits on the accelerator to decide which path to take.
        """
        table = self._id_tables[cfg.name]
        if table.device.type == "meta":
            if weight.device.type == "meta":
                raise RuntimeError(
                    f"HashEmbeddingBagCollection table '{cfg.name}' is on the meta device; materialise or shard "
                    "the module before running it"
                )
            table = self._id_tables[cfg.name] = self._new_id_table(cfg, self._real_device())
        ids = values[0] if len(values) == 1 else torch.cat(values)
        if self.training:
            rows = table.find_or_insert(ids)
            reassigned = table.take_reassigned_rows()
            if reassigned.numel():
                init_rows_(weight, reassigned, cfg)
                for pending in self._optimizer_listeners:
                    pending.setdefault(cfg.name, []).append(reassigned)
        else:
            rows = table.find(ids)
        parts = [rows] if len(values) == 1 else list(rows.split([v.numel() for v in values]))
        all_present = [bool(p) for p in torch.stack([(part >= 0).all() for part in parts]).tolist()]
        rows = rows.to(weight.device)
        if len(values) == 1:
            return [rows], all_present
        return list(rows.split([v.numel() for v in values])), all_present

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
