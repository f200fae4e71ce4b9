"""``RowLedger``: which rows each batch in flight holds, and which rows are owed a reset.

Mapping a batch ahead of its compute (a pipeline does) creates two obligations that last until
the batch computes:

* **holds**: its rows must not be evicted (and handed to another id) under it, so they are
  pinned in their id tables, but only in tables with an eviction policy (a table without one
  never frees a row by itself). A batch's mapping is one step of each table and writes its
  rows' last use, and the batches in flight are the latest steps, so the ledger pins by step:
  each table is pinned from the step of its oldest batch in flight
  (:meth:`~recsdk.embedding.IdTable.pin_since`), which pins exactly the rows of the batches in
  flight (a batch dropped in between keeps its rows pinned until the older ones have
  computed). That is one integer per table and batch, where pinning the rows themselves took
  two passes over them (a pin and an unpin) and a dozen torch calls per table;
* **resets**: rows its mapping took from evicted ids need a fresh embedding and zeroed
  optimizer state before its lookup. They are reset when the batch starts computing, on the
  training thread, never by the host thread while another batch computes on the same weights
  (no batch in flight holds them: held rows are never evicted).

Every obligation is keyed by the batch's token and written through this small API by the
host stage (:meth:`owe`, :meth:`hold`), the compute (:meth:`release_finished`,
:meth:`start_compute`), a pipeline dropping a batch (:meth:`release`) and a checkpoint
(:meth:`owed_resets`, :meth:`forgive_resets`). A batch that fails or is dropped passes its
resets on to the next batch that computes: the rows belong to new ids all the same.

Duties: ``hold``/``owe`` for a token come before its ``start_compute`` or ``release``; every
token ends in exactly one of them. Thread-safe: the host thread and the training thread call it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from recsdk.embedding import IdTable

__all__ = ["RowLedger"]

Rows = dict[str, torch.Tensor]
Steps = dict[str, int]


def _merge(into: dict[str, list[torch.Tensor]], rows: Mapping[str, torch.Tensor]) -> None:
    for name, chunk in rows.items():
        if chunk.numel() > 0:
            into.setdefault(name, []).append(chunk)


class RowLedger:
    """The row obligations of the batches of one sharded module's id tables.

    Args:
        tables (Mapping[str, IdTable]): this rank's id tables by table name (pins go there).
        lock (threading.RLock): the lock that guards those tables (the host stage's).

    Example::

        ledger = RowLedger(id_tables, lock)
        ledger.owe(ctx.token, reassigned)       # host stage: rows taken from evicted ids
        ledger.hold(ctx.token)                  # mapped ahead: keep its rows
        ledger.release_finished()               # compute: the previous batch is done
        resets = ledger.start_compute(ctx.token)
    """

    def __init__(self, tables: Mapping[str, IdTable], lock: threading.RLock) -> None:
        self._tables = tables
        self._lock = lock
        self._held: dict[int, Steps] = {}  # per batch mapped ahead, the step of each table it made
        self._owed: dict[int, dict[str, list[torch.Tensor]]] = {}
        self._owed_next: dict[str, list[torch.Tensor]] = {}  # by whichever batch computes next
        self._computing: Steps = {}

    def owe(self, token: int, rows: Mapping[str, torch.Tensor]) -> None:
        """Batch ``token`` owes ``rows`` (per table) a reset before its lookup."""
        with self._lock:
            _merge(self._owed.setdefault(token, {}), rows)

    def hold(self, token: int) -> None:
        """Batch ``token`` was just mapped ahead (the latest step of each table): pin its rows
        until it has computed."""
        with self._lock:
            self._held[token] = {n: t.step for n, t in self._tables.items() if t.eviction is not None}
            self._pin_in_flight()

    def release(self, token: int) -> None:
        """Batch ``token`` will never compute: unpin its rows; its resets go to the next compute."""
        with self._lock:
            if self._held.pop(token, None) is not None:
                self._pin_in_flight()
            for name, chunks in self._owed.pop(token, {}).items():
                self._owed_next.setdefault(name, []).extend(chunks)

    def release_finished(self) -> None:
        """The computing batch's backward is done: its rows may be evicted again."""
        with self._lock:
            if self._computing:
                self._computing = {}
                self._pin_in_flight()

    def start_compute(self, token: int) -> Rows:
        """Batch ``token`` computes now: its holds last until :meth:`release_finished`.

        Returns:
            dict[str, torch.Tensor]: per table, the unique rows to reset before its lookup
            (its own and those passed on by failed or dropped batches); no longer owed.
        """
        with self._lock:
            self._computing = self._held.pop(token, {})
            chunks = self._owed_next
            self._owed_next = {}
            for name, own in self._owed.pop(token, {}).items():
                chunks.setdefault(name, []).extend(own)
        return {name: torch.unique(torch.cat(c)) for name, c in chunks.items()}

    def _pin_in_flight(self) -> None:
        """Pin each table from the step of its oldest batch in flight (held or computing), or
        nothing where none is."""
        in_flight = [*self._held.values(), self._computing]
        for name, table in self._tables.items():
            steps = [held[name] for held in in_flight if name in held]
            table.pin_since(min(steps) if steps else None)

    def owed_resets(self) -> Rows:
        """Per table, every row still owed a reset (by batches in flight, failed or dropped)."""
        with self._lock:
            chunks: dict[str, list[torch.Tensor]] = {n: list(c) for n, c in self._owed_next.items()}
            for owed in self._owed.values():
                for name, c in owed.items():
                    chunks.setdefault(name, []).extend(c)
        return {name: torch.unique(torch.cat(c)) for name, c in chunks.items() if c}

    def forgive_resets(self) -> None:
        """Drop every owed reset (a checkpoint load replaced the tables and their rows)."""
        with self._lock:
            self._owed.clear()
            self._owed_next.clear()
