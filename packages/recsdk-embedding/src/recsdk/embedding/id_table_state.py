"""``IdTableState``: the state format of an :class:`~recsdk.embedding.IdTable`, in one place.

What a table's state is as tensors (:meth:`IdTableState.state_dict`, assembled from what each of
the table's parts gives of itself), how a state is checked (:meth:`IdTableState.checked`), how
the ids and metadata of :meth:`IdTable.rebuild` and the pairs of :meth:`IdTable.insert_at` are
checked, and how a checked state is loaded into a freshly reset table's parts
(:meth:`IdTableState.load`). A part of ``IdTable``: it calls the other parts' public methods.

The keys (:data:`STATE_KEYS`):

* ``capacity``, ``step``: scalars;
* ``ids``, ``rows``, ``last_step``, ``freq``: one entry per stored id, ascending rows;
* ``free_rows``: the free-row stack, bottom to top, under the rows never handed out
  (``capacity - 1`` down to the high-water mark);
* ``retired_rows``: free rows whose embedding holds a former id; ``reassigned_rows``: rows not
  yet taken by :meth:`IdTable.take_reassigned_rows`;
* ``admission_counters``: the count-min sketch (empty without one);
* ``stats``: int64 ``[5]``, :data:`STAT_NAMES`;
* ``scores`` (int64, one per stored id with :class:`ScoreEviction`, else empty) and
  ``score_counters`` (the :class:`ScoreAdmission` sketch, else empty): show/click scores in fixed
  point in the units of step ``score_ref`` (a scalar; see :mod:`~recsdk.embedding.id_table_scores`).
  Optional on load, so states saved before scores existed still load.

Pins are runtime state and are not saved.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from recsdk.embedding.id_table_admission import IdTableAdmission
from recsdk.embedding.id_table_eviction import IdTableEviction
from recsdk.embedding.id_table_scores import IdTableScores
from recsdk.embedding.id_table_step import STAT_NAMES
from recsdk.embedding.policies import AdmissionPolicy, EvictionPolicy
from recsdk.embedding.row_allocator import RowAllocator
from recsdk.embedding.row_map import RowMap
from recsdk.embedding.row_states import INT32_MAX

__all__ = ["STATE_KEYS", "IdTableState"]

STATE_KEYS = (
    "capacity",
    "ids",
    "rows",
    "last_step",
    "freq",
    "free_rows",
    "retired_rows",
    "reassigned_rows",
    "admission_counters",
    "step",
    "stats",
    "scores",
    "score_counters",
    "score_ref",
)
"""The keys of a state."""
_OPTIONAL_KEYS = ("scores", "score_counters", "score_ref")  # absent from states saved before show/click scores


class IdTableState:
    """The state format of one id table.

    Args:
        name (str): the table's name, for errors.
        capacity (int): the table's rows.
        device (torch.device): the table's device.
        policies (tuple): the table's admission and eviction policies, for errors.
        rows (RowAllocator): the table's rows.
        row_map (RowMap): places the loaded ids.
        admission (IdTableAdmission): its admission counters.
        eviction (IdTableEviction): its eviction metadata.
        scores (IdTableScores | None): its show/click scores.

    Example::

        sd = state.state_dict(step=table.step, stats=counters)
        checked = state.checked(sd)  # raises ValueError, changes nothing
    """

    def __init__(
        self,
        name: str,
        capacity: int,
        device: torch.device,
        policies: tuple[AdmissionPolicy | None, EvictionPolicy | None],
        rows: RowAllocator,
        row_map: RowMap,
        admission: IdTableAdmission,
        eviction: IdTableEviction,
        scores: IdTableScores | None,
    ) -> None:
        self._name = name
        self._capacity = capacity
        self._device = device
        self._policies = policies
        self._rows = rows
        self._map = row_map
        self._eviction = eviction
        self._admission = admission
        self._scores = scores

    def state_dict(self, *, step: int, stats: dict[str, int]) -> dict[str, torch.Tensor]:
        """The table's state (see :meth:`IdTable.state_dict`), at clock ``step`` with ``stats``."""
        ids, rows = self._rows.ids_and_rows()
        last_step, freq = self._eviction.metadata(rows)
        free = self._rows.free_state()
        empty = torch.zeros(0, dtype=torch.int64, device=self._device)
        scores = (
            self._scores.state(rows)
            if self._scores is not None
            else {"scores": empty, "score_counters": empty.clone(), "score_ref": torch.tensor(0, dtype=torch.int64)}
        )
        return {
            "capacity": torch.tensor(self._capacity, dtype=torch.int64),
            "ids": ids,
            "rows": rows,
            "last_step": last_step,
            "freq": freq,
            "free_rows": free["free_rows"],
            "retired_rows": free["retired_rows"],
            "reassigned_rows": free["reassigned_rows"],
            "admission_counters": self._admission.counters(),
            "step": torch.tensor(step, dtype=torch.int64),
            "stats": torch.tensor([stats[k] for k in STAT_NAMES], dtype=torch.int64),
            **scores,
        }

    def load(self, sd: dict[str, torch.Tensor]) -> tuple[int, dict[str, int]]:
        """Load a checked state (:meth:`checked`, or :meth:`checked_rebuild`: no free rows, so
        ids at rows ``0..n-1`` and every other row retired) into the parts of a freshly reset
        table; returns its step clock and statistics."""
        rows = sd["rows"]
        if "free_rows" in sd:
            self._rows.restore(sd["free_rows"], sd["retired_rows"], sd["reassigned_rows"])
        else:
            self._rows.restore_prefix(rows.numel())
        self._map.place(sd["ids"], rows, step=0)
        self._eviction.restore(rows, sd["last_step"], sd["freq"])
        self._admission.restore(sd["admission_counters"])
        if self._scores is not None:
            self._scores.restore(rows, sd["scores"], sd["score_counters"], int(sd["score_ref"]))
        return int(sd["step"]), dict(zip(STAT_NAMES, (int(v) for v in sd["stats"].tolist()), strict=True))

    def insert_at(self, ids: torch.Tensor, rows: torch.Tensor, meta: dict[str, torch.Tensor], *, step: int) -> None:
        """Store pairs checked by :meth:`checked_insert_at` (``meta``: its result) at ``step``."""
        self._rows.claim(rows)
        self._map.place(ids, rows, step=step)
        self._eviction.given(rows, meta.get("last_step"), meta.get("freq"))

    # ------------------------------------------------------------------ checks (read only)

    def checked(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Validate a :meth:`state_dict`; returns its tensors on the table's device, flattened.

        Raises:
            ValueError: missing keys, another capacity, inconsistent ids/rows, or counters of another size.
        """
        name, cap = self._name, self._capacity
        missing = [k for k in STATE_KEYS if k not in state_dict and k not in _OPTIONAL_KEYS]
        if missing:
            raise ValueError(f"IdTable '{name}': state dict lacks keys {missing}")
        absent = {"scores": torch.zeros(0, dtype=torch.int64), "score_counters": torch.zeros(0, dtype=torch.int64)}
        absent["score_ref"] = torch.tensor(0, dtype=torch.int64)
        sd = {k: torch.as_tensor(state_dict[k] if k in state_dict else absent[k]).to(self._device) for k in STATE_KEYS}
        if int(sd["capacity"]) != cap:
            raise ValueError(
                f"IdTable '{name}': state dict is for capacity {int(sd['capacity'])}, this table has capacity {cap}"
            )
        ids = sd["ids"].reshape(-1).long()
        rows = sd["rows"].reshape(-1).long()
        free = sd["free_rows"].reshape(-1).long()
        n = ids.numel()
        for key in ("rows", "last_step", "freq"):
            if sd[key].numel() != n:
                raise ValueError(f"IdTable '{name}': state dict has {n} ids but {sd[key].numel()} {key}")
        every = torch.cat([rows, free])
        in_range = every.numel() == cap and bool(((every >= 0) & (every < cap)).all())
        seen = torch.zeros(cap, dtype=torch.bool, device=self._device)
        if in_range:
            seen[every] = True  # capacity entries covering every row: each row exactly once
        if not in_range or not bool(seen.all()):
            raise ValueError(
                f"IdTable '{name}': state dict rows and free_rows must together hold each row "
                f"of [0, {cap}) exactly once"
            )
        if ids.unique().numel() != n:
            raise ValueError(f"IdTable '{name}': state dict ids are not distinct")
        counters = sd["admission_counters"].reshape(-1)
        have = self._admission.num_counters
        if counters.numel() != have:
            raise ValueError(
                f"IdTable '{name}': state dict has {counters.numel()} admission counters, this table's "
                f"admission policy {self._policies[0]} has {have}"
            )
        scores, score_counters = sd["scores"].reshape(-1), sd["score_counters"].reshape(-1)
        if self._scores is not None:
            self._scores.check_state(
                f"IdTable '{name}': state dict", n, scores, score_counters, int(sd["score_ref"]), int(sd["step"])
            )
        elif scores.numel() or score_counters.numel():
            raise ValueError(
                f"IdTable '{name}': state dict holds show/click scores, this table's policies keep none "
                f"(admission {self._policies[0]}, eviction {self._policies[1]})"
            )
        stats = sd["stats"].reshape(-1)
        if stats.numel() != len(STAT_NAMES):
            raise ValueError(f"IdTable '{name}': state dict stats must have {len(STAT_NAMES)} entries")
        retired = sd["retired_rows"].reshape(-1).long()
        reassigned = sd["reassigned_rows"].reshape(-1).long()
        for key, value in (("retired_rows", retired), ("reassigned_rows", reassigned)):
            if value.numel() and bool(((value < 0) | (value >= cap)).any()):
                raise ValueError(f"IdTable '{name}': state dict {key} out of [0, {cap})")
        return {
            "ids": ids,
            "rows": rows,
            "last_step": sd["last_step"].reshape(-1),
            "freq": sd["freq"].reshape(-1),
            "free_rows": free,
            "retired_rows": retired,
            "reassigned_rows": reassigned,
            "admission_counters": counters,
            "step": sd["step"],
            "stats": stats,
            "scores": scores,
            "score_counters": score_counters,
            "score_ref": sd["score_ref"],
        }

    def checked_rebuild(
        self,
        ids: torch.Tensor,
        *,
        last_step: torch.Tensor,
        freq: torch.Tensor,
        step: int,
        admission_counters: torch.Tensor | None,
        scores: torch.Tensor | None,
        score_counters: torch.Tensor | None,
        score_ref: int | None,
    ) -> dict[str, torch.Tensor]:
        """Validate :meth:`IdTable.rebuild`'s arguments (``ids``: int64 ``[n]``); returns them as a
        checked state of ids at rows ``0..n-1`` (no free rows: the caller sets them).

        Raises:
            ValueError: as :meth:`IdTable.rebuild`.
        """
        n, cap = ids.numel(), self._capacity
        where = f"IdTable '{self._name}'.rebuild"
        if n > cap:
            raise ValueError(f"{where}: {n} ids do not fit the table's capacity {cap}")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= INT32_MAX:
            raise ValueError(f"{where}: step must be an int in [0, {INT32_MAX}], got {step!r}")
        meta = {}
        for key, value in (("last_step", last_step), ("freq", freq)):
            value = torch.as_tensor(value).reshape(-1).to(self._device)
            if value.numel() != n or value.is_floating_point() or value.dtype == torch.bool:
                raise ValueError(f"{where}: {key} must be {n} integers (one per id), got {value.numel()} {value.dtype}")
            if n and bool(((value < 0) | (value > INT32_MAX)).any()):
                raise ValueError(f"{where}: {key} must be in [0, {INT32_MAX}]")
            meta[key] = value.long()
        if n and ids.unique().numel() != n:
            raise ValueError(f"{where}: ids must be distinct")
        have = self._admission.num_counters
        if admission_counters is None:
            counters = torch.zeros(have, dtype=torch.int32, device=self._device)
        else:
            counters = torch.as_tensor(admission_counters).reshape(-1)
            if counters.numel() != have:
                raise ValueError(
                    f"{where}: {counters.numel()} admission counters given, this table's admission policy "
                    f"{self._policies[0]} has {have}"
                )
        zeros = torch.zeros(0, dtype=torch.int64, device=self._device)
        if self._scores is None:
            scores = score_counters = zeros
        else:
            if scores is None:
                scores = torch.zeros(n if self._scores.per_row else 0, dtype=torch.int64)
            if score_counters is None:
                score_counters = torch.zeros(self._scores.num_counters, dtype=torch.int64)
            scores, score_counters = torch.as_tensor(scores).reshape(-1), torch.as_tensor(score_counters).reshape(-1)
            self._scores.check_state(where, n, scores, score_counters, step if score_ref is None else score_ref, step)
        return {
            "ids": ids,
            "rows": torch.arange(n, dtype=torch.int64, device=self._device),
            "last_step": meta["last_step"],
            "freq": meta["freq"],
            "admission_counters": counters,
            "step": torch.tensor(step, dtype=torch.int64),
            "stats": torch.zeros(len(STAT_NAMES), dtype=torch.int64),
            "scores": scores,
            "score_counters": score_counters,
            "score_ref": torch.tensor(step if score_ref is None else score_ref, dtype=torch.int64),
        }

    def checked_insert_at(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        *,
        last_step: torch.Tensor | None,
        freq: torch.Tensor | None,
        find: Callable[[torch.Tensor], torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """Validate :meth:`IdTable.insert_at`'s pairs (int64 ``ids [n]``, ``rows [n]`` in range);
        returns the given metadata as int32 (keys ``last_step``, ``freq`` where given).

        Args:
            find (Callable): the table's lookup of ids (rows, ``-1`` where absent; reads only).

        Raises:
            ValueError: as :meth:`IdTable.insert_at`.
        """
        where = f"IdTable '{self._name}'"
        n = ids.numel()
        if rows.numel() != n:
            raise ValueError(f"{where}: insert_at got {n} ids but {rows.numel()} rows")
        meta = {}
        for key, value in (("last_step", last_step), ("freq", freq)):
            if value is not None:
                value = torch.as_tensor(value).reshape(-1).to(self._device)
                if value.numel() != n or value.is_floating_point() or value.dtype == torch.bool:
                    raise ValueError(f"{where}: insert_at {key} must be {n} integers")
                if bool(((value < 0) | (value > INT32_MAX)).any()):
                    raise ValueError(f"{where}: insert_at {key} must be in [0, {INT32_MAX}]")
                meta[key] = value.to(torch.int32)
        if n == 0:
            return meta
        if ids.unique().numel() != n:
            raise ValueError(f"{where}: insert_at ids must be distinct")
        if rows.unique().numel() != n:
            raise ValueError(f"{where}: insert_at rows must be distinct")
        present = find(ids) >= 0
        if bool(present.any()):
            raise ValueError(f"{where}: insert_at id {int(ids[present][0])} is already in the table; remove it first")
        _, taken = self._rows.occupants(rows)
        if bool(taken.any()):
            raise ValueError(f"{where}: insert_at row {int(rows[taken][0])} already holds an id")
        return meta
