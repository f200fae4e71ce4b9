"""The id-table side of the hash embedding modules, written once for all of them.

:class:`~recsdk.embedding.HashEmbeddingBagCollection` and
:class:`~recsdk.embedding.HashEmbeddingCollection` are TorchRec's embedding modules with raw ids
in front. What they share (one :class:`~recsdk.embedding.IdTable` per table, created lazily on the
real device when the module was built on ``meta``; mapping ids to rows with reassigned rows
re-initialised and reported to attached optimizers; the id-table state dict) is
:class:`HashIdTables`, which each module composes, as TorchRec's managed-collision modules compose
an embedding module with a collision module. :class:`HashIdTablesMixin` gives both modules the
same public methods over it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from recsdk.embedding.config import HashTableConfig
from recsdk.embedding.id_table import IdTable
from recsdk.embedding.input_checks import check_features
from recsdk.embedding.policies import score_of
from recsdk.embedding.row_init import init_rows_, reset_optimizer_rows_

__all__ = [
    "HashIdTables",
    "HashIdTablesMixin",
    "OptimizerAttachment",
    "check_tables",
    "click_tables",
    "jagged_per_feature",
]

WeightOf = Callable[[str], torch.Tensor]
"""Table name -> that table's ``[num_embeddings, dim]`` weight, as the owning module holds it now."""


def check_tables(tables: object, config_type: type, *, module: str) -> None:
    """Reject anything but a non-empty list of ``config_type`` configs, naming the module and the table.

    Args:
        tables (object): the ``tables`` argument of a hash module's constructor.
        config_type (type): the config class the module takes.
        module (str): the module's name for the messages.

    Raises:
        ValueError: ``tables`` is not a non-empty list.
        TypeError: an entry is not a ``config_type``.
    """
    if not isinstance(tables, list) or not tables:
        raise ValueError(f"{module}: tables must be a non-empty list, got {tables!r}")
    for i, cfg in enumerate(tables):
        if not isinstance(cfg, config_type):
            raise TypeError(
                f"{module}: tables[{i}] (name {getattr(cfg, 'name', '?')!r}) must be a "
                f"{config_type.__name__}, got {type(cfg).__name__}"
            )


def click_tables(configs: Sequence[object]) -> list[str]:
    """The tables whose show/click score reads clicks (``beta > 0``): their ids' clicks come as the
    sparse features' per-id weights (``recsdk.data.Batch.with_clicks()``).

    Args:
        configs (Sequence[object]): table configs (plain TorchRec configs have no policies).

    Returns:
        list[str]: their names, in config order.
    """
    out = []
    for cfg in configs:
        score = score_of(getattr(cfg, "admission", None), getattr(cfg, "eviction", None))
        if score is not None and score.needs_clicks:
            out.append(str(getattr(cfg, "name", "")))
    return out


def check_click_input(features: KeyedJaggedTensor, tables: Sequence[str], *, module: str) -> None:
    """Raise unless a training batch for tables that score clicks carries them as per-id weights.

    Args:
        features (KeyedJaggedTensor): a KJT that passed :func:`~recsdk.embedding.check_features`.
        tables (Sequence[str]): the module's tables that read clicks (:func:`click_tables`).
        module (str): the module's name for the message.

    Raises:
        ValueError: no weights, or not one per id.
        TypeError: weights that are not floating point.
    """
    weights = features.weights_or_none()
    if weights is None:
        raise ValueError(
            f"{module}: table(s) {list(tables)} score clicks (ShowClickScore with beta > 0), which a training batch "
            "brings as the sparse features' per-id weights, but the KJT has no weights. Build the batch with "
            "recsdk.data.Batch.with_clicks() (each id gets its sample's label), or set beta=0 to score shows only"
        )
    if not weights.dtype.is_floating_point:
        raise TypeError(f"{module}: the clicks (KJT weights) must be floating point, got {weights.dtype}")
    if weights.dim() != 1 or weights.numel() != features.values().numel():
        raise ValueError(
            f"{module}: the KJT has weights of shape {list(weights.shape)}; clicks need one per id "
            f"({features.values().numel()})"
        )


def jagged_per_feature(features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
    """``features.to_dict()``, also for a batch of size 0 (where TorchRec's ``to_dict`` fails).

    Args:
        features (KeyedJaggedTensor): a KJT that passed :func:`~recsdk.embedding.check_features`.

    Returns:
        dict[str, JaggedTensor]: feature name -> its ids (and weights), ``[B]`` lengths and
        ``[B + 1]`` offsets.
    """
    lengths = features.lengths()
    if lengths.numel() == 0:
        values, weights = features.values(), features.weights_or_none()
        return {
            key: JaggedTensor(values=values[:0], lengths=lengths[:0], weights=None if weights is None else weights[:0])
            for key in features.keys()
        }
    return features.to_dict()


class OptimizerAttachment:
    """Handle returned by ``attach_optimizer`` of the hash modules; ``remove()`` detaches."""

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


class HashIdTables:
    """One :class:`~recsdk.embedding.IdTable` per hash table config, and the id-to-row mapping.

    Not a module: the id tables are neither parameters nor buffers, so the planner and the
    sharders see only the owning module's weights, and ``state_dict()`` holds only weights. A table
    whose device is ``meta`` is a placeholder: the first :meth:`map_ids` (or
    :meth:`load_state_dict`) on real weights replaces it with an empty table on the real device
    (``device`` if that is not meta, else the weight's device).

    Args:
        configs (Sequence[HashTableConfig]): the tables (names distinct); each id table has the
            config's capacity (``num_embeddings``), admission and eviction, and is named after it.
        device (torch.device): where the id tables live (``meta``: placeholders).
        module (str): the owning module's name for messages, e.g. ``"HashEmbeddingCollection"``.

    Example::

        tables = HashIdTables(configs, device=torch.device("cpu"), module="HashEmbeddingCollection")
        [rows], [all_present] = tables.map_ids("item", weight, [ids], training=True)
    """

    def __init__(self, configs: Sequence[HashTableConfig], *, device: torch.device, module: str) -> None:
        self._configs: dict[str, HashTableConfig] = {cfg.name: cfg for cfg in configs}
        self._device = device
        self._module = module
        self._tables: dict[str, IdTable] = {cfg.name: self._new_table(cfg, device) for cfg in configs}
        self._feature_names: list[str] = list(dict.fromkeys(n for cfg in configs for n in cfg.feature_names))
        self._click_tables: list[str] = click_tables(configs)
        self._listeners: list[dict[str, list[torch.Tensor]]] = []

    @property
    def tables(self) -> dict[str, IdTable]:
        """Table name -> its :class:`~recsdk.embedding.IdTable`."""
        return self._tables

    @property
    def feature_names(self) -> list[str]:
        """Every configured feature, once, in config order."""
        return self._feature_names

    def check_input(self, features: object, *, is_weighted: bool, training: bool = False) -> KeyedJaggedTensor:
        """:func:`~recsdk.embedding.check_features` against the configured features, named after the module.

        Run it before any id table changes: it rejects unknown or missing keys, ids that are not
        int64/int32, missing weights and lengths that do not match the ids; and, in training, a
        KJT without clicks (weights) for tables that score them.
        """
        kjt = check_features(features, self._feature_names, module=self._module, is_weighted=is_weighted)
        if training and self._click_tables:
            check_click_input(kjt, self._click_tables, module=self._module)
        return kjt

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per-table id table statistics (see :meth:`IdTable.stats`)."""
        return {name: table.stats() for name, table in self._tables.items()}

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Table name -> :meth:`IdTable.state_dict`."""
        return {name: table.state_dict() for name, table in self._tables.items()}

    def load_state_dict(self, state_dict: dict[str, dict[str, torch.Tensor]], weight_of: WeightOf) -> None:
        """Restore every id table from :meth:`state_dict` (all tables must be present, no others).

        Meta placeholders are first replaced by tables on the real device (see the class).
        """
        missing = sorted(set(self._tables) - set(state_dict))
        extra = sorted(set(state_dict) - set(self._tables))
        if missing or extra:
            raise ValueError(f"{self._module}.load_id_table_state_dict: tables missing {missing}, unexpected {extra}")
        for name, table in list(self._tables.items()):
            if table.device.type == "meta":
                table = self._tables[name] = self._new_table(self._configs[name], self._real_device(weight_of(name)))
            table.load_state_dict(state_dict[name])

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, weight_of: WeightOf) -> OptimizerAttachment:
        """Reset ``optimizer``'s per-row state of the rows reassigned since its last step, before each step.

        Args:
            optimizer (torch.optim.Optimizer): a plain torch optimizer over the module's weights.
            weight_of (Callable[[str], torch.Tensor]): table name -> its weight, read at each step.

        Returns:
            OptimizerAttachment: ``handle.remove()`` detaches it.
        """
        pending: dict[str, list[torch.Tensor]] = {}
        self._listeners.append(pending)

        def reset(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            for name, chunks in list(pending.items()):
                rows = torch.cat(chunks).unique()
                reset_optimizer_rows_(opt, weight_of(name), rows)
            pending.clear()

        return OptimizerAttachment(optimizer.register_step_pre_hook(reset), pending, self._listeners)

    def map_ids(
        self,
        name: str,
        weight: torch.Tensor,
        values: list[torch.Tensor],
        *,
        training: bool,
        clicks: list[torch.Tensor | None] | None = None,
    ) -> tuple[list[torch.Tensor], list[bool]]:
        """Rows (on the weight's device) of each feature's ids, and whether each feature has a row for all its ids.

        The features of one table are mapped in one id table call (one step), so they agree on
        rows. Training inserts (``find_or_insert``); rows reassigned to new ids are re-initialised
        with the table's ``init_fn`` and reported to attached optimizers, before any lookup.
        Otherwise it only finds (no id table state changes). Ids without a row get ``-1``.

        The "all present" flags are computed on the id table's device (the host, usually) before
        the rows move, in one transfer per table, so the caller never waits on the accelerator to
        decide which lookup path to take.

        Args:
            name (str): the table.
            weight (torch.Tensor): its ``[num_embeddings, dim]`` weight.
            values (list[torch.Tensor]): the ids of each of its features (``[n_f]``, int64/int32).
            training (bool): insert (True) or only find (False).
            clicks (list[torch.Tensor | None] | None): each feature's per-id weights; a table that
                scores clicks reads them in training (see :func:`click_tables`).

        Returns:
            tuple[list[torch.Tensor], list[bool]]: ``[n_f]`` int64 rows per feature, and the flags.
        """
        table = self._tables[name]
        cfg = self._configs[name]
        if table.device.type == "meta":
            if weight.device.type == "meta":
                raise RuntimeError(
                    f"{self._module} table '{name}' is on the meta device; materialise or shard "
                    "the module before running it"
                )
            table = self._tables[name] = self._new_table(cfg, self._real_device(weight))
        sizes = [v.numel() for v in values]
        ids = values[0] if len(values) == 1 else torch.cat(values)
        if training:
            id_clicks = None
            if clicks is not None and name in self._click_tables:
                parts = [c for c in clicks if c is not None]
                if len(parts) == len(values):
                    id_clicks = parts[0] if len(parts) == 1 else torch.cat(parts)
            rows = table.find_or_insert(ids, id_clicks)
            reassigned = table.take_reassigned_rows()
            if reassigned.numel():
                init_rows_(weight, reassigned, cfg)
                for pending in self._listeners:
                    pending.setdefault(name, []).append(reassigned)
        else:
            rows = table.find(ids)
        parts = [rows] if len(values) == 1 else list(rows.split(sizes))
        all_present = [bool(p) for p in torch.stack([(part >= 0).all() for part in parts]).tolist()]
        rows = rows.to(weight.device)
        return ([rows] if len(values) == 1 else list(rows.split(sizes))), all_present

    @staticmethod
    def _new_table(cfg: HashTableConfig, device: torch.device) -> IdTable:
        return IdTable(cfg.num_embeddings, device=device, admission=cfg.admission, eviction=cfg.eviction, name=cfg.name)

    def _real_device(self, weight: torch.Tensor) -> torch.device:
        return self._device if self._device.type != "meta" else weight.device


class HashIdTablesMixin:
    """The public id-table methods of a hash embedding module, over its ``_hash_tables``.

    The module calls :meth:`_init_hash_tables` in its constructor (after TorchRec's, which sets
    ``_device``) and implements :meth:`_hash_weight`.
    """

    _hash_tables: HashIdTables
    _device: torch.device

    def _init_hash_tables(
        self, tables: Sequence[HashTableConfig], id_table_device: torch.device | str | None, *, module: str
    ) -> None:
        """Create ``_hash_tables`` on ``id_table_device``, defaulting to the module's ``device``."""
        device = torch.device(id_table_device) if id_table_device is not None else self._device
        self._hash_tables = HashIdTables(tables, device=device, module=module)

    def _hash_weight(self, name: str) -> torch.Tensor:
        """Table name -> its current ``[num_embeddings, dim]`` weight."""
        raise NotImplementedError

    @property
    def id_tables(self) -> dict[str, IdTable]:
        """Table name -> its :class:`~recsdk.embedding.IdTable` (shared by the table's features)."""
        return self._hash_tables.tables

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per-table id table statistics (see :meth:`IdTable.stats`)."""
        return self._hash_tables.stats()

    def id_table_state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Table name -> :meth:`IdTable.state_dict`; save it beside :meth:`state_dict`."""
        return self._hash_tables.state_dict()

    def load_id_table_state_dict(self, state_dict: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore the id tables from :meth:`id_table_state_dict` (every table must be present)."""
        self._hash_tables.load_state_dict(state_dict, self._hash_weight)

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
        return self._hash_tables.attach_optimizer(optimizer, self._hash_weight)
