"""A collision-free map from raw int64 ids to embedding rows, with admission and eviction.

``IdTable`` checks what its callers give it and orchestrates parts that each own their arrays
(torch tensors on the table's device, so every operation is whole-batch):

* :class:`~recsdk.embedding.row_map.RowMap`: the hash index (:mod:`~recsdk.embedding.slot_index`)
  and the rows (:class:`~recsdk.embedding.row_allocator.RowAllocator`: ``row_id``, the row state of
  :mod:`~recsdk.embedding.row_states`, the free rows, the rows to report as reassigned);
* :class:`~recsdk.embedding.id_table_eviction.IdTableEviction`: ``last_step`` and ``freq`` per row,
  the idle floor, the queue of the oldest rows; it chooses victims, the table frees them;
* :class:`~recsdk.embedding.id_table_pins.IdTablePins`: reference counts per row;
* :class:`~recsdk.embedding.id_table_admission.IdTableAdmission`: the count sketch;
* :class:`~recsdk.embedding.id_table_scores.IdTableScores`: show/click scores;
* :class:`~recsdk.embedding.id_table_publishing.IdTablePublishing`: the change tracker, a
  version's snapshot and commit; public as :attr:`IdTable.publishing`;
* :class:`~recsdk.embedding.id_table_state.IdTableState`: the state format and the replacing of
  the table's contents (the work of ``state_dict``, ``load_state_dict``, ``check_state_dict``);
  public as :attr:`IdTable.state` for ``rebuild`` and ``insert_at``;
* :class:`~recsdk.embedding.id_table_step.IdTableSteps`: the step clock, the statistics and
  :meth:`IdTable.find_or_insert`'s two halves (what a step does, worked out before anything
  changes; then its commit).
"""

from __future__ import annotations

from typing import Any

import torch

from recsdk.embedding.change_tracker import RowChangeTracker
from recsdk.embedding.id_table_admission import IdTableAdmission
from recsdk.embedding.id_table_eviction import IdTableEviction, TableFullError
from recsdk.embedding.id_table_inputs import check_table, check_usable, checked_clicks, checked_ids, checked_rows
from recsdk.embedding.id_table_pins import IdTablePins
from recsdk.embedding.id_table_publishing import IdTablePublishing
from recsdk.embedding.id_table_scores import IdTableScores
from recsdk.embedding.id_table_state import STATE_KEYS, IdTableState
from recsdk.embedding.id_table_step import IdTableSteps
from recsdk.embedding.policies import AdmissionPolicy, EvictionPolicy, check_policies
from recsdk.embedding.row_allocator import RowAllocator
from recsdk.embedding.row_map import RowMap
from recsdk.embedding.slot_index import FbgemmSlotIndex

__all__ = ["IdTable", "TableFullError"]


class IdTable:
    """Collision-free map from raw int64 ids to rows in ``[0, capacity)``.

    Two different ids never share a row, and an id keeps its row until it is evicted. Every
    operation works on a whole batch with torch tensor operations (no per-id Python loop), so
    the table runs on CPU, CUDA or NPU tensors alike. Any int64 value is a valid id, including
    ``0``, negative values, ``INT64_MIN`` and ``INT64_MAX``; int32 ids are sign-extended.

    One :meth:`find_or_insert` call is one step: it advances the step clock used by LRU and TTL,
    and counts each distinct id once for admission and LFU frequency. Steps are stored per row as
    int32, so a table serves up to ``2**31 - 1`` steps. The table is not thread-safe: callers that
    share one across threads serialise the calls.

    Args:
        capacity (int): number of rows (the embedding table's ``num_embeddings``).
        device (torch.device | str): where the table lives. ``"meta"`` allocates nothing and
            cannot be used for lookups (a placeholder for a module built on the meta device).
        admission (CountAdmission | ScoreAdmission | ProbabilisticAdmission | None): admit ids only
            after enough sightings, once their show/click score reaches a threshold, or by chance;
            None admits at once.
        eviction (LRUEviction | LFUEviction | TTLEviction | ScoreEviction | None): what frees rows
            when the table is full; None raises :class:`TableFullError` instead.
        name (str): table name, used in errors and statistics.
        report_first_use (bool): :meth:`take_reassigned_rows` also reports rows handed to an id
            for the first time, not only rows taken from evicted ids (for row stores that
            initialise a row when it is first used, such as a file-backed store).

    Memory: resident memory follows the rows the table uses, not its capacity: the hash index
    starts small and doubles as ids arrive (22.4 bytes per row at full size on CPU, 6 to 12
    elsewhere; :func:`~recsdk.embedding.slot_index.index_bytes`), and the per-row arrays (25 bytes
    per row) are, on CPU, anonymous memory maps resident only where written. Plus the admission
    counters and, with :class:`ScoreEviction`, 8 bytes per row of scores. :attr:`memory_bytes`
    gives the allocated figure.

    Example::

        table = IdTable(1 << 20, eviction=LRUEviction(), name="user")
        rows = table.find_or_insert(torch.tensor([7, -3, 7, 2**63 - 1]))  # tensor([1, 0, 1, 2])
        table.find(torch.tensor([7, 8]))  # tensor([1, -1])
    """

    STATE_KEYS: tuple[str, ...] = STATE_KEYS
    """The keys of :meth:`state_dict`."""

    def __init__(
        self,
        capacity: int,
        *,
        device: torch.device | str = "cpu",
        admission: AdmissionPolicy | None = None,
        eviction: EvictionPolicy | None = None,
        name: str = "id_table",
        report_first_use: bool = False,
    ) -> None:
        check_table(name, capacity)
        check_policies(f"IdTable '{name}'", admission, eviction)
        dev = torch.device(device)
        self._name, self._capacity, self._device = name, capacity, dev
        self._admission_policy, self._eviction_policy = admission, eviction
        self._scores = IdTableScores.for_policies(admission, eviction, capacity, dev)  # show/click scores
        self._rows = RowAllocator(capacity, dev, report_first_use=bool(report_first_use))
        self._pins = IdTablePins(name, capacity, dev)
        self._eviction = IdTableEviction(
            name, eviction, self._rows, self._pins, self._scores, capacity=capacity, device=dev
        )
        self._admission = IdTableAdmission(admission, self._scores, dev)
        self._publishing = IdTablePublishing(name, self._rows, lambda ids: self._map.lookup(ids), capacity, dev)
        self._map = RowMap(self._rows, self._eviction, self._scores, self._publishing, capacity=capacity, device=dev)
        parts = (self._rows, self._map, self._admission, self._eviction, self._scores)
        self._steps = IdTableSteps(*parts, policy=eviction, capacity=capacity, device=dev)
        self._state = IdTableState(
            name, capacity, dev, (admission, eviction), *parts, self._pins, self._publishing, self._steps
        )

    # ------------------------------------------------------------------ properties

    @property
    def capacity(self) -> int:
        """Number of rows."""
        return self._capacity

    @property
    def name(self) -> str:
        """The table's name."""
        return self._name

    @property
    def device(self) -> torch.device:
        """Where the table's tensors live."""
        return self._device

    @property
    def admission(self) -> AdmissionPolicy | None:
        """The admission policy (None: admit at once)."""
        return self._admission_policy

    @property
    def eviction(self) -> EvictionPolicy | None:
        """The eviction policy (None: a full table raises :class:`TableFullError`)."""
        return self._eviction_policy

    @property
    def step(self) -> int:
        """Number of :meth:`find_or_insert` calls so far (restored by :meth:`load_state_dict`)."""
        return self._steps.step

    @property
    def index_kind(self) -> str:
        """Which hash index maps ids to rows: ``"fbgemm"`` (FBGEMM's kernels, CPU) or ``"torch"``."""
        return "fbgemm" if isinstance(self._map.index, FbgemmSlotIndex) else "torch"

    @property
    def num_slots(self) -> int:
        """Number of slots of the hash index (see :mod:`recsdk.embedding.slot_index`)."""
        return self._map.index.num_slots

    @property
    def memory_bytes(self) -> int:
        """Bytes the table's tensors hold: the index's slots (current size), the per-row arrays
        (allocated for the whole capacity; on CPU resident only where written) and the admission
        counters."""
        tensors = self._rows.tensors() + self._eviction.tensors() + self._pins.tensors() + self._admission.tensors()
        if self._scores is not None:
            tensors += self._scores.tensors()
        return self._map.index.memory_bytes + sum(t.numel() * t.element_size() for t in tensors)

    @property
    def changes(self) -> RowChangeTracker | None:
        """The tracker of changed rows and departed ids (None until ``publishing.track()``)."""
        return self._publishing.tracker

    @property
    def publishing(self) -> IdTablePublishing:
        """The table's publishing part: :meth:`IdTablePublishing.track` its changes, then a version's
        :meth:`IdTablePublishing.snapshot` and :meth:`IdTablePublishing.commit` (what
        ``recsdk.sharding.Publisher`` calls, under the lock that serialises the table's callers)."""
        return self._publishing

    def __len__(self) -> int:
        return self._rows.size

    def __repr__(self) -> str:
        return (
            f"IdTable(name={self._name!r}, capacity={self._capacity}, size={self._rows.size}, "
            f"device={self._device}, admission={self._admission_policy}, eviction={self._eviction_policy})"
        )

    # ------------------------------------------------------------------ mapping

    def find_or_insert(self, ids: torch.Tensor, clicks: torch.Tensor | None = None) -> torch.Tensor:
        """Map ids to rows, giving new admitted ids a row (one training step).

        Duplicates within the batch map to one row. Ids not (yet) admitted map to ``-1`` and get
        no row. When there are not enough free rows, the eviction policy frees rows that are
        neither pinned nor used by this batch; the freed rows handed to new ids are reported by
        :meth:`take_reassigned_rows`.

        Args:
            ids (torch.Tensor): int64 or int32 ids, any shape, on any device (moved to the table's).
            clicks (torch.Tensor | None): the clicks of each occurrence (same number of elements as
                ``ids``, floating point, finite, >= 0), for a show/click score
                (:class:`ShowClickScore`); None counts no clicks. Ignored by other policies.

        Returns:
            torch.Tensor: int64 rows, same shape as ``ids``, on the table's device; ``-1`` for ids
            not admitted.

        Raises:
            TableFullError: the new ids do not fit and no eviction policy is set, or eviction cannot
                free enough rows (all pinned or in use). The table is left unchanged.
            TypeError, ValueError: bad ``ids`` or ``clicks`` (the table is left unchanged).
        """
        flat, shape = self._as_ids(ids, "find_or_insert")
        where = f"IdTable '{self._name}'.find_or_insert"
        click_values = checked_clicks(clicks, flat.numel(), where) if clicks is not None else None
        return self._steps.run(flat, click_values).view(shape)

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Map ids to rows without inserting anything (evaluation).

        Changes no state at all: not the step clock, eviction metadata, admission counts nor the
        statistics (lookups made through ``find`` are not counted in :meth:`stats`).

        Args:
            ids (torch.Tensor): int64 or int32 ids, any shape.

        Returns:
            torch.Tensor: int64 rows, same shape as ``ids``; ``-1`` for ids not in the table.
        """
        flat, shape = self._as_ids(ids, "find")
        return self._map.lookup(flat).view(shape)

    def scores(self, ids: torch.Tensor) -> torch.Tensor:
        """The show/click scores of ``ids`` at the current step (reads only).

        An id with a row has its row's score (with :class:`ScoreEviction`); an id without one, its
        admission sketch estimate (with :class:`ScoreAdmission`; an upper bound), else 0.

        Args:
            ids (torch.Tensor): int64 or int32 ids, any shape.

        Returns:
            torch.Tensor: float64 scores, same shape as ``ids``.

        Raises:
            ValueError: the table keeps no scores (neither policy is by score).
        """
        flat, shape = self._as_ids(ids, "scores")
        if self._scores is None:
            raise ValueError(
                f"IdTable '{self._name}' keeps no show/click scores: its admission ({self._admission_policy}) and "
                f"eviction ({self._eviction_policy}) are not ScoreAdmission / ScoreEviction"
            )
        return self._scores.of(flat, self._map.lookup(flat), self._steps.step).view(shape)

    def take_reassigned_rows(self) -> torch.Tensor:
        """Rows handed to a new id after having held another one, since the last call; clears the list.

        With ``report_first_use``, every row handed to a new id is reported, its first use too.
        The caller re-initialises these embedding rows and resets their optimizer state before
        they are looked up.

        Returns:
            torch.Tensor: sorted distinct int64 rows on the table's device.
        """
        return self._rows.take_pending()

    def remove(self, ids: torch.Tensor) -> torch.Tensor:
        """Remove ids from the table and free their rows (e.g. to move them to another table).

        Args:
            ids (torch.Tensor): int64 or int32 ids, any shape; ids not in the table are ignored.

        Returns:
            torch.Tensor: int64 rows the ids held, same shape as ``ids``; ``-1`` for absent ids.

        Raises:
            ValueError: one of the rows is pinned (the table is left unchanged).
        """
        flat, shape = self._as_ids(ids, "remove")
        rows = self._map.lookup(flat)
        present = rows[rows >= 0].unique()
        if present.numel():
            self._eviction.refuse_pinned(present, "remove")
            self._map.free(present)
        return rows.view(shape)

    def ids_and_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored ids and their rows, in ascending row order.

        Returns:
            tuple[torch.Tensor, torch.Tensor]: int64 ``ids [n]`` and int64 ``rows [n]``.
        """
        self._check_usable()
        return self._rows.ids_and_rows()

    def occupants(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids stored at ``rows`` and which of the rows hold one.

        Args:
            rows (torch.Tensor): int64 ``[n]`` rows in ``[0, capacity)``.

        Returns:
            tuple[torch.Tensor, torch.Tensor]: int64 ``ids [n]`` (meaningless where not occupied)
            and bool ``occupied [n]``.
        """
        self._check_usable()
        return self._rows.occupants(rows)

    def stats(self) -> dict[str, Any]:
        """Table statistics.

        ``lookups``/``hits`` count ids (with repeats) passed to :meth:`find_or_insert` and found
        already stored; ``inserts`` counts ids given a row; ``evictions`` counts rows freed by the
        eviction policy (when full, or idle under TTL, or by score); ``admission_rejects`` counts,
        per call, the distinct ids refused a row by admission.

        Returns:
            dict: ``size``, ``capacity``, ``inserts``, ``evictions``, ``admission_rejects``,
            ``lookups``, ``hits`` (ints) and ``hit_rate`` (float, 0.0 before any lookup); with
            :class:`ScoreEviction` also ``score_sum`` and ``score_min`` (floats: the stored ids'
            show/click scores at the current step; 0.0 when empty).
        """
        out: dict[str, Any] = {"size": self._rows.size, "capacity": self._capacity}
        out.update(self._steps.counts())
        out["hit_rate"] = out["hits"] / out["lookups"] if out["lookups"] else 0.0
        if self._scores is not None and self._scores.per_row:
            out.update(self._scores.totals(self._rows.occupied_rows(), self._steps.step))
        return out

    # ------------------------------------------------------------------ pins and eviction

    def pin(self, rows: torch.Tensor) -> None:
        """Protect rows from eviction and reassignment: one reference per occurrence (int32 counts);
        ``-1`` entries are ignored, so :meth:`find_or_insert`'s output can be passed as is.

        Args:
            rows (torch.Tensor): integer rows in ``[-1, capacity)``, any shape.
        """
        self._pins.add(self._as_rows(rows, "pin", allow_missing=True))

    def unpin(self, rows: torch.Tensor) -> None:
        """Drop references taken by :meth:`pin` (same rows, same multiplicity).

        Raises:
            ValueError: a row would drop below zero references (the table is left unchanged).
        """
        self._pins.drop(self._as_rows(rows, "unpin", allow_missing=True))

    def pin_since(self, step: int | None) -> None:
        """Pin every row last used at ``step`` or later, until the next call (None: unpin them).

        A step watermark beside :meth:`pin`'s references: a pipeline's batches in flight are
        consecutive steps, so pinning from the step of the oldest one pins exactly their rows,
        for the cost of one integer per batch. A table without an eviction policy evicts nothing
        and keeps no last uses: there it pins nothing. Replacing the state (:meth:`load_state_dict`,
        :meth:`rebuild`) drops it.

        Args:
            step (int | None): a step ``>= 0`` (see :attr:`step`), or None.
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"IdTable '{self._name}'.pin_since: step must be an int >= 0 or None, got {step!r}")
        self._pins.pin_since(step if self._eviction_policy is not None else None)

    def num_pinned(self) -> int:
        """Number of rows with a pin (:meth:`pin`'s references, or :meth:`pin_since`'s watermark)."""
        return self._eviction.num_pinned()

    def evict_idle(self, max_idle_steps: int | None = None) -> torch.Tensor:
        """Free every unpinned row idle for more than ``max_idle_steps`` steps (an explicit TTL sweep);
        does not advance the step clock. Rows used at the latest step are never idle.

        Args:
            max_idle_steps (int | None): defaults to the table's :class:`TTLEviction` setting.

        Returns:
            torch.Tensor: the freed rows (int64, ascending).
        """
        limit = self._eviction.idle_limit(max_idle_steps)
        self._check_usable()
        rows = self._eviction.idle_rows(limit, self._steps.step, force=True)
        self._steps.free_evicted(rows)
        return rows

    # ------------------------------------------------------------------ state (the work: IdTableState)

    @property
    def state(self) -> IdTableState:
        """The table's state part: :meth:`IdTableState.rebuild` and :meth:`IdTableState.insert_at`
        replace or add to its contents from ids gathered elsewhere (a checkpoint loaded on another
        world size); the restore family below calls it."""
        return self._state

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The table's full state as tensors (pins are runtime state and are not included).

        Returns:
            dict[str, torch.Tensor]: keys :attr:`STATE_KEYS`; what each holds is written in
            :mod:`~recsdk.embedding.id_table_state`.
        """
        self._check_usable()
        return self._state.state_dict()

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Restore a state from :meth:`state_dict` of a table with the same capacity; checked first, so
        on error the table is left unchanged (:meth:`IdTableState.load_state_dict`).

        Args:
            state_dict (dict[str, torch.Tensor]): a state from :meth:`state_dict`.

        Raises:
            ValueError: missing keys, another capacity, inconsistent ids/rows, or counters of another size.
            RuntimeError: some rows of this table are pinned.
        """
        self._check_usable()
        self._state.load_state_dict(state_dict)

    def check_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Raise if :meth:`load_state_dict` would refuse ``state_dict``; changes nothing (so a caller
        can check every table's state before it modifies any; :meth:`IdTableState.checked`).

        Args:
            state_dict (dict[str, torch.Tensor]): a state from :meth:`state_dict`.

        Raises:
            ValueError: as :meth:`load_state_dict` (pins are not checked here).
        """
        self._check_usable()
        self._state.checked(state_dict)

    def index_state(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The hash index as FBGEMM's ``pruned_hashmap_lookup`` reads it, for a lookup outside Python
        (a serving module under TorchScript): see :meth:`FbgemmSlotIndex.kernel_state`.

        Raises:
            RuntimeError: the table's index is not FBGEMM's (not on CPU, or FBGEMM not loaded).
        """
        index = self._map.index
        if not isinstance(index, FbgemmSlotIndex):
            raise RuntimeError(f"IdTable '{self._name}': its index is {self.index_kind!r}, not FBGEMM's (CPU)")
        return index.kernel_state()

    # ------------------------------------------------------------------ internals

    def _check_usable(self) -> None:
        check_usable(self._name, self._device)

    def _as_ids(self, ids: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.Size]:
        check_usable(self._name, self._device)
        return checked_ids(ids, f"IdTable '{self._name}'.{op}", self._device)

    def _as_rows(self, rows: torch.Tensor, op: str, *, allow_missing: bool) -> torch.Tensor:
        check_usable(self._name, self._device)
        where = f"IdTable '{self._name}'.{op}"
        return checked_rows(rows, where, self._capacity, self._device, allow_missing=allow_missing)
