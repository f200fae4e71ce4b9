"""``IdTableState``: the state format of :class:`~recsdk.embedding.IdTable`, in one place.

What a table's state is as tensors (:meth:`IdTableState.state_dict`), how a state is checked
and restored (:meth:`~IdTableState.check_state_dict`, :meth:`~IdTableState.load_state_dict`),
and how a table is rebuilt from ids and their metadata gathered elsewhere
(:meth:`~IdTableState.rebuild`, e.g. by a checkpoint loaded on another world size), or given
``(id, row)`` pairs stored (:meth:`~IdTableState.insert_at`). A mixin of
``IdTable``: it reads the table's own arrays; nothing outside the table does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from recsdk.embedding.count_sketch import CountMinSketch
    from recsdk.embedding.id_table_scores import IdTableScores
    from recsdk.embedding.oldest_rows import OldestRows
    from recsdk.embedding.policies import AdmissionPolicy, EvictionPolicy

__all__ = ["IdTableState"]

_NEVER_USED = 0
_OCCUPIED = 1
_RETIRED = 2  # free again, but its embedding row holds a former id's values
_MAX_CAPACITY = 2**31 - 2
_INT32_MAX = 2**31 - 1
_STAT_NAMES = ("inserts", "evictions", "admission_rejects", "lookups", "hits")
_STATE_KEYS = (
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
_OPTIONAL_KEYS = ("scores", "score_counters", "score_ref")  # absent from states saved before show/click scores


class IdTableState:
    """The state format of an :class:`~recsdk.embedding.IdTable` (a mixin of it).

    Attributes:
        STATE_KEYS (tuple[str, ...]): the keys of :meth:`state_dict`.
    """

    STATE_KEYS: tuple[str, ...] = _STATE_KEYS

    if TYPE_CHECKING:  # the table's arrays and helpers this mixin reads (defined by IdTable)
        _name: str
        _capacity: int
        _device: torch.device
        _sketch: CountMinSketch | None
        _scores: IdTableScores | None
        _admission: AdmissionPolicy | None
        _eviction: EvictionPolicy | None
        _last_step: torch.Tensor
        _oldest: OldestRows
        _freq: torch.Tensor
        _free: torch.Tensor
        _free_top: int
        _high_water: int
        _tail_retired: bool
        _row_state: torch.Tensor
        _reassigned: list[torch.Tensor]
        _reassigned_count: int
        _step: int
        _stats: dict[str, int]

        def ids_and_rows(self) -> tuple[torch.Tensor, torch.Tensor]: ...
        def num_pinned(self) -> int: ...
        def _check_usable(self) -> None: ...
        def _allocate(self) -> None: ...
        def _as_ids(self, ids: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.Size]: ...
        def _place(self, ids: torch.Tensor, rows: torch.Tensor, *, step: int) -> None: ...
        def _pending_rows(self) -> torch.Tensor: ...
        def _as_rows(self, rows: torch.Tensor, op: str, *, allow_missing: bool) -> torch.Tensor: ...
        def _lookup(self, ids: torch.Tensor) -> torch.Tensor: ...
        def _drop_pending(self, rows: torch.Tensor) -> None: ...

        _idle_floor: int

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The table's full state as tensors (pins are runtime state and are not included).

        Keys: ``capacity``, ``step`` (scalars); ``ids``, ``rows``, ``last_step``, ``freq`` (one entry
        per stored id, ascending rows); ``free_rows`` (the free-row stack, bottom to top);
        ``retired_rows`` (free rows whose embedding holds a former id); ``reassigned_rows`` (not yet
        taken by :meth:`take_reassigned_rows`); ``admission_counters`` (empty without a sketch);
        ``stats`` (int64 ``[5]``: inserts, evictions, admission_rejects, lookups, hits);
        ``scores`` (int64, one per stored id with :class:`ScoreEviction`, else empty) and
        ``score_counters`` (the :class:`ScoreAdmission` sketch, else empty): show/click scores
        in fixed point in the units of step ``score_ref`` (a scalar; see
        :mod:`~recsdk.embedding.id_table_scores`).

        The rows never handed out (at and above the high-water mark) are written out as the
        bottom of the free stack, ``capacity - 1`` down to the mark.
        """
        self._check_usable()
        ids, rows = self.ids_and_rows()
        hw, dev = self._high_water, self._device
        retired = (self._row_state[:hw] == _RETIRED).nonzero().squeeze(1)
        if self._tail_retired:
            retired = torch.cat([retired, torch.arange(hw, self._capacity, device=dev)])
        counters = (
            self._sketch.counters.clone() if self._sketch is not None else torch.zeros(0, dtype=torch.int32, device=dev)
        )
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        scores = (
            self._scores.state(rows)
            if self._scores is not None
            else {"scores": empty, "score_counters": empty.clone(), "score_ref": torch.tensor(0, dtype=torch.int64)}
        )
        return {
            "capacity": torch.tensor(self._capacity, dtype=torch.int64),
            "ids": ids,
            "rows": rows,
            "last_step": self._last_step[rows].clone(),
            "freq": self._freq[rows].clone(),
            "free_rows": torch.cat(
                [torch.arange(self._capacity - 1, hw - 1, -1, device=dev), self._free[: self._free_top].long()]
            ),
            "retired_rows": retired,
            "reassigned_rows": self._pending_rows(),
            "admission_counters": counters,
            "step": torch.tensor(self._step, dtype=torch.int64),
            "stats": torch.tensor([self._stats[k] for k in _STAT_NAMES], dtype=torch.int64),
            **scores,
        }

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Restore a state from :meth:`state_dict` of a table with the same capacity.

        The slot layout is rebuilt from the ids. The state is validated first (as by
        :meth:`check_state_dict`); on error the table is left unchanged.

        Raises:
            ValueError: missing keys, another capacity, inconsistent ids/rows, or counters of another size.
            RuntimeError: some rows of this table are pinned.
        """
        sd = self._checked_state(state_dict)
        self._check_unpinned()
        free, retired, cap = sd["free_rows"], sd["retired_rows"], self._capacity
        # The rows above the mark: the bottom of the stack while it reads capacity - 1, capacity - 2,
        # ... (the order they go out in from the mark) and its rows are all retired or all not (one
        # flag says which); the rest of the stack is kept as it is.
        descending = torch.arange(cap - 1, cap - 1 - free.numel(), -1, device=self._device)
        breaks = (free != descending).nonzero()
        run = int(breaks[0]) if breaks.numel() else free.numel()
        is_retired = torch.zeros(cap, dtype=torch.bool, device=self._device)
        is_retired[retired] = True
        tail_retired = run > 0 and bool(is_retired[cap - 1])
        odd = (is_retired[cap - run :] != tail_retired).nonzero()
        hw = cap - run + (int(odd[-1]) + 1 if odd.numel() else 0)
        self._allocate()
        self._high_water, self._tail_retired = hw, tail_retired
        stacked = free[cap - hw :]  # the rest of the stack, all below the mark
        self._free_top = stacked.numel()
        self._free[: self._free_top] = stacked.to(torch.int32)
        self._row_state[retired[retired < hw]] = _RETIRED
        self._restore(sd)

    def check_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Raise if :meth:`load_state_dict` would refuse ``state_dict``; changes nothing.

        Lets a caller that restores several tables (and their embeddings) validate every state
        before it modifies any of them.

        Args:
            state_dict (dict[str, torch.Tensor]): a state from :meth:`state_dict`.

        Raises:
            ValueError: as :meth:`load_state_dict` (pins are not checked here).
        """
        self._checked_state(state_dict)

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

        For rebuilding a table from ids and their metadata gathered elsewhere (e.g. a
        checkpoint loaded on another world size): id ``ids[i]`` gets row ``i`` with its
        ``last_step`` and ``freq``. The other rows are free, handed out in ascending order, and
        each is reported by :meth:`take_reassigned_rows` when handed to an id (its embedding row
        may hold another model's values, so the caller re-initialises it). The step clock is set
        to ``step``, the admission counters to ``admission_counters``, and the statistics start
        from zero. On error the table is left unchanged.

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
            RuntimeError: some rows of this table are pinned.

        Example::

            table = IdTable(8, eviction=LRUEviction())
            table.rebuild(torch.tensor([42, 7]), last_step=torch.tensor([3, 5]), freq=torch.ones(2), step=5)
            table.find(torch.tensor([7, 42]))  # tensor([1, 0])
        """
        flat, _ = self._as_ids(ids, "rebuild")
        n, cap = flat.numel(), self._capacity
        where = f"IdTable '{self._name}'.rebuild"
        if n > cap:
            raise ValueError(f"{where}: {n} ids do not fit the table's capacity {cap}")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _INT32_MAX:
            raise ValueError(f"{where}: step must be an int in [0, {_INT32_MAX}], got {step!r}")
        meta = {}
        for key, value in (("last_step", last_step), ("freq", freq)):
            value = torch.as_tensor(value).reshape(-1).to(self._device)
            if value.numel() != n or value.is_floating_point() or value.dtype == torch.bool:
                raise ValueError(f"{where}: {key} must be {n} integers (one per id), got {value.numel()} {value.dtype}")
            if n and bool(((value < 0) | (value > _INT32_MAX)).any()):
                raise ValueError(f"{where}: {key} must be in [0, {_INT32_MAX}]")
            meta[key] = value.long()
        if n and flat.unique().numel() != n:
            raise ValueError(f"{where}: ids must be distinct")
        have = self._sketch.counters.numel() if self._sketch is not None else 0
        if admission_counters is None:
            counters = torch.zeros(have, dtype=torch.int32, device=self._device)
        else:
            counters = torch.as_tensor(admission_counters).reshape(-1)
            if counters.numel() != have:
                raise ValueError(
                    f"{where}: {counters.numel()} admission counters given, this table's admission policy "
                    f"{self._admission} has {have}"
                )
        zeros = torch.zeros(0, dtype=torch.int64, device=self._device)
        if self._scores is None:
            scores = score_counters = zeros
        else:
            if scores is None:
                scores = torch.zeros(n if self._scores.rows is not None else 0, dtype=torch.int64)
            if score_counters is None:
                score_counters = torch.zeros(self._scores.num_counters, dtype=torch.int64)
            scores, score_counters = torch.as_tensor(scores).reshape(-1), torch.as_tensor(score_counters).reshape(-1)
            self._scores.check_state(where, n, scores, score_counters, step if score_ref is None else score_ref, step)
        self._check_unpinned()
        self._allocate()
        # Rows n, n+1, ... go out in ascending order, each reported (retired): the tail above the mark.
        self._high_water, self._tail_retired = n, True
        self._restore(
            {
                "ids": flat,
                "rows": torch.arange(n, dtype=torch.int64, device=self._device),
                "last_step": meta["last_step"],
                "freq": meta["freq"],
                "reassigned_rows": torch.zeros(0, dtype=torch.int64, device=self._device),
                "admission_counters": counters,
                "step": torch.tensor(step, dtype=torch.int64),
                "stats": torch.zeros(len(_STAT_NAMES), dtype=torch.int64),
                "scores": scores,
                "score_counters": score_counters,
                "score_ref": torch.tensor(step if score_ref is None else score_ref, dtype=torch.int64),
            }
        )

    def insert_at(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        *,
        last_step: torch.Tensor | None = None,
        freq: torch.Tensor | None = None,
    ) -> None:
        """Store given ``(id, row)`` pairs, e.g. to rebuild a table from another one's ids.

        Bypasses admission. The rows are not reported by :meth:`take_reassigned_rows`: the caller
        provides their embedding values.

        Args:
            ids (torch.Tensor): int64/int32 ``[n]`` distinct ids, none already in the table.
            rows (torch.Tensor): integer ``[n]`` distinct free rows in ``[0, capacity)``.
            last_step (torch.Tensor | None): int ``[n]`` step each id was last used; defaults to the current step.
            freq (torch.Tensor | None): int ``[n]`` LFU frequencies; defaults to 1.

        Raises:
            ValueError: on any of the conditions above (the table is left unchanged).
        """
        flat, _ = self._as_ids(ids, "insert_at")
        rows = self._as_rows(rows, "insert_at", allow_missing=False)
        n = flat.numel()
        if rows.numel() != n:
            raise ValueError(f"IdTable '{self._name}': insert_at got {n} ids but {rows.numel()} rows")
        meta = {}
        for key, value in (("last_step", last_step), ("freq", freq)):
            if value is not None:
                value = torch.as_tensor(value).reshape(-1).to(self._device)
                if value.numel() != n or value.is_floating_point() or value.dtype == torch.bool:
                    raise ValueError(f"IdTable '{self._name}': insert_at {key} must be {n} integers")
                if bool(((value < 0) | (value > _INT32_MAX)).any()):
                    raise ValueError(f"IdTable '{self._name}': insert_at {key} must be in [0, {_INT32_MAX}]")
                meta[key] = value.to(torch.int32)
        if n == 0:
            return
        if flat.unique().numel() != n:
            raise ValueError(f"IdTable '{self._name}': insert_at ids must be distinct")
        if rows.unique().numel() != n:
            raise ValueError(f"IdTable '{self._name}': insert_at rows must be distinct")
        present = self._lookup(flat) >= 0
        if bool(present.any()):
            raise ValueError(
                f"IdTable '{self._name}': insert_at id {int(flat[present][0])} is already in the table; remove it first"
            )
        taken = self._row_state[rows] == _OCCUPIED
        if bool(taken.any()):
            raise ValueError(f"IdTable '{self._name}': insert_at row {int(rows[taken][0])} already holds an id")
        # Rows at or above the mark that stay free join the bottom of the stack in the order they
        # would have gone out (ascending), then the given rows leave the stack.
        hw, top = self._high_water, max(self._high_water, int(rows.max()) + 1)
        stack = torch.cat([torch.arange(top - 1, hw - 1, -1, device=self._device), self._free[: self._free_top].long()])
        if self._tail_retired:
            self._row_state[hw:top] = _RETIRED
        self._high_water = top
        keep = torch.ones(top, dtype=torch.bool, device=self._device)
        keep[rows] = False
        stack = stack[keep[stack]]
        self._free_top = stack.numel()
        self._free[: self._free_top] = stack.to(torch.int32)
        self._drop_pending(rows)
        self._place(flat, rows, step=self._step)
        self._idle_floor = 0
        if "last_step" in meta:
            self._last_step[rows] = meta["last_step"]
            self._oldest.clear()  # last steps written out of order
        if "freq" in meta:
            self._freq[rows] = meta["freq"]
        self._stats["inserts"] += n

    def _check_unpinned(self) -> None:
        """Raise while some rows are pinned (a batch in flight holds them): nothing may replace them."""
        if self.num_pinned():
            raise RuntimeError(f"IdTable '{self._name}': load_state_dict while {self.num_pinned()} rows are pinned")

    def _restore(self, sd: dict[str, torch.Tensor]) -> None:
        """Store the ids, their metadata, counters, clock and statistics of ``sd`` in a freshly
        allocated table whose free rows are already set."""
        rows = sd["rows"]
        self._place(sd["ids"], rows, step=0)
        self._last_step[rows] = sd["last_step"].to(torch.int32)
        self._freq[rows] = sd["freq"].to(torch.int32)
        if self._sketch is not None:
            self._sketch.counters.copy_(sd["admission_counters"].to(torch.int32))
        reassigned = sd["reassigned_rows"]
        if reassigned.numel():
            self._reassigned = [reassigned]
            self._reassigned_count = reassigned.numel()
        self._step = int(sd["step"])
        self._stats = dict(zip(_STAT_NAMES, (int(v) for v in sd["stats"].tolist()), strict=True))
        if self._scores is not None:
            self._scores.restore(rows, sd["scores"], sd["score_counters"], int(sd["score_ref"]))

    def _checked_state(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Validate a :meth:`state_dict`; returns its tensors on the table's device, flattened."""
        self._check_usable()
        missing = [k for k in _STATE_KEYS if k not in state_dict and k not in _OPTIONAL_KEYS]
        if missing:
            raise ValueError(f"IdTable '{self._name}': state dict lacks keys {missing}")
        absent = {"scores": torch.zeros(0, dtype=torch.int64), "score_counters": torch.zeros(0, dtype=torch.int64)}
        absent["score_ref"] = torch.tensor(0, dtype=torch.int64)
        sd = {k: torch.as_tensor(state_dict[k] if k in state_dict else absent[k]).to(self._device) for k in _STATE_KEYS}
        cap = int(sd["capacity"])
        if cap != self._capacity:
            raise ValueError(
                f"IdTable '{self._name}': state dict is for capacity {cap}, this table has capacity {self._capacity}"
            )
        ids = sd["ids"].reshape(-1).long()
        rows = sd["rows"].reshape(-1).long()
        free = sd["free_rows"].reshape(-1).long()
        n = ids.numel()
        for key in ("rows", "last_step", "freq"):
            if sd[key].numel() != n:
                raise ValueError(f"IdTable '{self._name}': state dict has {n} ids but {sd[key].numel()} {key}")
        every = torch.cat([rows, free])
        in_range = every.numel() == self._capacity and bool(((every >= 0) & (every < self._capacity)).all())
        seen = torch.zeros(self._capacity, dtype=torch.bool, device=self._device)
        if in_range:
            seen[every] = True  # capacity entries covering every row: each row exactly once
        if not in_range or not bool(seen.all()):
            raise ValueError(
                f"IdTable '{self._name}': state dict rows and free_rows must together hold each row "
                f"of [0, {self._capacity}) exactly once"
            )
        if ids.unique().numel() != n:
            raise ValueError(f"IdTable '{self._name}': state dict ids are not distinct")
        counters = sd["admission_counters"].reshape(-1)
        have = self._sketch.counters.numel() if self._sketch is not None else 0
        if counters.numel() != have:
            raise ValueError(
                f"IdTable '{self._name}': state dict has {counters.numel()} admission counters, this table's "
                f"admission policy {self._admission} has {have}"
            )
        scores, score_counters = sd["scores"].reshape(-1), sd["score_counters"].reshape(-1)
        if self._scores is not None:
            self._scores.check_state(
                f"IdTable '{self._name}': state dict", n, scores, score_counters, int(sd["score_ref"]), int(sd["step"])
            )
        elif scores.numel() or score_counters.numel():
            raise ValueError(
                f"IdTable '{self._name}': state dict holds show/click scores, this table's policies keep none "
                f"(admission {self._admission}, eviction {self._eviction})"
            )
        stats = sd["stats"].reshape(-1)
        if stats.numel() != len(_STAT_NAMES):
            raise ValueError(f"IdTable '{self._name}': state dict stats must have {len(_STAT_NAMES)} entries")
        retired = sd["retired_rows"].reshape(-1).long()
        reassigned = sd["reassigned_rows"].reshape(-1).long()
        for key, value in (("retired_rows", retired), ("reassigned_rows", reassigned)):
            if value.numel() and bool(((value < 0) | (value >= self._capacity)).any()):
                raise ValueError(f"IdTable '{self._name}': state dict {key} out of [0, {self._capacity})")
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
