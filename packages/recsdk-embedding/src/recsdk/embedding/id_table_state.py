"""``IdTableState``: the state format of an :class:`~recsdk.embedding.IdTable`, in one place.

A public part of ``IdTable`` (:attr:`IdTable.state`): the work of the table's
:meth:`IdTable.state_dict`, :meth:`IdTable.load_state_dict` and :meth:`IdTable.check_state_dict`,
and the replacing of its contents from ids gathered elsewhere (:meth:`IdTableState.rebuild`,
:meth:`IdTableState.insert_at`, what checkpoint loading calls): what a table's state is as tensors
(assembled from what each of the table's parts gives of itself), how a state and the arguments of
``rebuild`` and ``insert_at`` are checked (read only: a refused call changes nothing), and how a
checked state replaces the table's contents (every part reset, then loaded). It calls the other
parts' public methods.

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

import torch

from recsdk.embedding.id_table_admission import IdTableAdmission
from recsdk.embedding.id_table_eviction import IdTableEviction
from recsdk.embedding.id_table_inputs import check_usable, checked_ids, checked_rows
from recsdk.embedding.id_table_pins import IdTablePins
from recsdk.embedding.id_table_publishing import IdTablePublishing
from recsdk.embedding.id_table_scores import IdTableScores
from recsdk.embedding.id_table_step import STAT_NAMES, IdTableSteps
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
    """The state format of one id table, and the replacing of its contents.

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
        pins (IdTablePins): its pins (nothing is replaced while a row is pinned).
        publishing (IdTablePublishing): its change tracker (reset with the contents).
        steps (IdTableSteps): its step clock and statistics.

    Example::

        sd = table.state_dict()  # IdTable's restore family calls this part
        table.check_state_dict(sd)  # raises ValueError, changes nothing
        table.load_state_dict(sd)
        table.state.insert_at(torch.tensor([42]), torch.tensor([3]))  # store a given (id, row)
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
        pins: IdTablePins,
        publishing: IdTablePublishing,
        steps: IdTableSteps,
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
        self._pins = pins
        self._publishing = publishing
        self._steps = steps

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The table's state, keys :data:`STATE_KEYS` (see the module docstring), at its step clock
        and with its statistics; pins are runtime state and are not included."""
        ids, rows = self._rows.ids_and_rows()
        last_step, freq = self._eviction.metadata(rows)
        free = self._rows.free_state()
        empty = torch.zeros(0, dtype=torch.int64, device=self._device)
        scores = (
            self._scores.state(rows)
            if self._scores is not None
            else {"scores": empty, "score_counters": empty.clone(), "score_ref": torch.tensor(0, dtype=torch.int64)}
        )
        stats = self._steps.counts()
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
            "step": torch.tensor(self._steps.step, dtype=torch.int64),
            "stats": torch.tensor([stats[k] for k in STAT_NAMES], dtype=torch.int64),
            **scores,
        }

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the table's contents by a state from :meth:`state_dict` of a table with the same
        capacity. The state is checked first (:meth:`checked`); on error the table is left
        unchanged. The slot layout is rebuilt from the ids; the change tracker is reset (the next
        published version is full).

        Raises:
            ValueError: as :meth:`checked`.
            RuntimeError: some rows of the table are pinned.
        """
        self._replace(self.checked(state_dict))

    def rebuild(
        self,
        ids: torch.Tensor,
        *,
        last_step: torch.Tensor,
        freq: torch.Tensor,
        step: int,
        admission_counters: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
        score_counters: torch.Tensor | None = None,
        score_ref: int | None = None,
    ) -> None:
        """Replace the table's contents by ``ids`` at rows ``0..n-1``, in the given order.

        For rebuilding a table from ids and their metadata gathered elsewhere (e.g. a checkpoint
        loaded on another world size): id ``ids[i]`` gets row ``i`` with its ``last_step`` and
        ``freq``. The other rows are free, handed out in ascending order, and each is reported by
        :meth:`IdTable.take_reassigned_rows` when handed to an id (its embedding row may hold
        another model's values, so the caller re-initialises it). The step clock is set to
        ``step``, the admission counters to ``admission_counters``, and the statistics start from
        zero. On error the table is left unchanged.

        Args:
            ids (torch.Tensor): int64/int32 ``[n]`` distinct ids, ``n <= capacity``.
            last_step (torch.Tensor): integer ``[n]`` step each id was last used, in ``[0, 2**31 - 1]``.
            freq (torch.Tensor): integer ``[n]`` LFU frequencies, in ``[0, 2**31 - 1]``.
            step (int): the step clock, ``>= 0``.
            admission_counters (torch.Tensor | None): the count-min sketch's counters (as in
                :meth:`state_dict`); None or empty for a table without a sketch, and None resets
                a sketch to zero.
            scores (torch.Tensor | None): int64 ``[n]`` stored show/click scores of the ids (as in
                :meth:`state_dict`), for :class:`ScoreEviction`; None: zeros.
            score_counters (torch.Tensor | None): the :class:`ScoreAdmission` sketch; None: zeros.
            score_ref (int | None): the reference step of ``scores`` and ``score_counters`` (None: ``step``).

        Raises:
            ValueError: more ids than rows, repeated ids, metadata or counters of the wrong size
                or out of range.
            RuntimeError: some rows of the table are pinned.

        Example::

            table = IdTable(8, eviction=LRUEviction())
            table.state.rebuild(torch.tensor([42, 7]), last_step=torch.tensor([3, 5]), freq=torch.ones(2), step=5)
            table.find(torch.tensor([7, 42]))  # tensor([1, 0])
        """
        where = f"IdTable '{self._name}'.rebuild"
        check_usable(self._name, self._device)
        ids = checked_ids(ids, where, self._device)[0]
        n, cap = ids.numel(), self._capacity
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
        sd = {
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
        self._replace(sd)

    def insert_at(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        *,
        last_step: torch.Tensor | None = None,
        freq: torch.Tensor | None = None,
    ) -> None:
        """Store given ``(id, row)`` pairs at the current step, bypassing admission; the rows are
        not reported by :meth:`IdTable.take_reassigned_rows` (the caller provides their embedding
        values). Checked first: on error the table is left unchanged.

        Args:
            ids (torch.Tensor): int64/int32 ``[n]`` distinct ids, none already in the table.
            rows (torch.Tensor): integer ``[n]`` distinct free rows in ``[0, capacity)``.
            last_step (torch.Tensor | None): int ``[n]`` step each id was last used; None: the current step.
            freq (torch.Tensor | None): int ``[n]`` LFU frequencies; None: 1.

        Raises:
            ValueError: on any of the conditions above.
        """
        where = f"IdTable '{self._name}'.insert_at"
        check_usable(self._name, self._device)
        ids = checked_ids(ids, where, self._device)[0]
        rows = checked_rows(rows, where, self._capacity, self._device, allow_missing=False)
        meta = self._checked_insert_at(ids, rows, last_step=last_step, freq=freq)
        if ids.numel():
            self._rows.claim(rows)
            self._map.place(ids, rows, step=self._steps.step)
            self._eviction.given(rows, meta.get("last_step"), meta.get("freq"))
            self._steps.count_inserts(ids.numel())

    # ------------------------------------------------------------------ replacing the contents

    def _replace(self, sd: dict[str, torch.Tensor]) -> None:
        """Replace the table's contents by a checked state (refused while rows are pinned)."""
        pinned = self._eviction.num_pinned()
        if pinned:
            raise RuntimeError(f"IdTable '{self._name}': load_state_dict while {pinned} rows are pinned")
        self._reset()
        self._steps.restore(*self._load(sd))

    def _reset(self) -> None:
        """Every part fresh: no ids, a new index, clock and statistics at zero (the tracker too:
        the rows' ids are replaced wholesale, so the next version is full)."""
        self._map.reset()
        self._pins.reset()
        self._eviction.reset()
        self._admission.reset()
        if self._scores is not None:
            self._scores.reset()
        self._publishing.reset()
        self._steps.reset()

    def _load(self, sd: dict[str, torch.Tensor]) -> tuple[int, dict[str, int]]:
        """Load a checked state (:meth:`checked`, or :meth:`rebuild`'s: no free rows, so
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

    def _checked_insert_at(
        self, ids: torch.Tensor, rows: torch.Tensor, *, last_step: torch.Tensor | None, freq: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """Validate :meth:`insert_at`'s pairs (int64 ``ids [n]``, ``rows [n]`` in range); returns
        the given metadata as int32 (keys ``last_step``, ``freq`` where given).

        Raises:
            ValueError: as :meth:`insert_at`.
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
        present = self._map.lookup(ids) >= 0
        if bool(present.any()):
            raise ValueError(f"{where}: insert_at id {int(ids[present][0])} is already in the table; remove it first")
        _, taken = self._rows.occupants(rows)
        if bool(taken.any()):
            raise ValueError(f"{where}: insert_at row {int(rows[taken][0])} already holds an id")
        return meta
