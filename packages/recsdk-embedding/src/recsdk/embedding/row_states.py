"""The per-row layout of an :class:`~recsdk.embedding.IdTable`: the states a row is in, and the
limits of its int32 rows and steps.

Every row of a table is in one of three states, kept in an int8 array beside the ids (so that
every int64 value is a valid id, none reserved for "empty"):

* :data:`NEVER_USED`: never handed out (or handed out with values the caller provides, by
  :meth:`IdTableState.insert_at`), so a new id given it needs no reset;
* :data:`OCCUPIED`: holds an id;
* :data:`RETIRED`: free again, but its embedding row holds a former id's values (a new id given
  it is reported by :meth:`IdTable.take_reassigned_rows`).

Rows, steps, last steps and LFU frequencies are stored as int32: a table has at most
:data:`MAX_CAPACITY` rows, and steps and frequencies stop at :data:`INT32_MAX`.

Example::

    from recsdk.embedding.row_states import MAX_CAPACITY, OCCUPIED

    assert capacity <= MAX_CAPACITY
    stored = (row_state == OCCUPIED).nonzero()
"""

from __future__ import annotations

__all__ = ["INT32_MAX", "MAX_CAPACITY", "NEVER_USED", "OCCUPIED", "RETIRED"]

NEVER_USED = 0
"""A row never handed out (a new id given it needs no reset)."""
OCCUPIED = 1
"""A row holding an id."""
RETIRED = 2
"""A free row whose embedding values are a former id's."""
MAX_CAPACITY = 2**31 - 2
"""The most rows a table has (rows are int32, with one spare entry at index ``capacity``)."""
INT32_MAX = 2**31 - 1
"""The largest step, last step or LFU frequency a table stores."""
