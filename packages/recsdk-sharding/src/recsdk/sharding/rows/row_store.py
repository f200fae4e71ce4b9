"""Row stores: where every row of a cached table shard lives, with its optimizer state.

A table sharded with a device cache (``compute_kernels=["fused_uvm_caching"]`` or
``["key_value"]``) keeps only some rows in the fused kernel; every row, with the per-row
optimizer state that goes with it, lives in a store, addressed by the id table's row (the id
table already is the index: no key-value database). Two stores, one shape:

* :class:`HostRowStore` (``fused_uvm_caching``): tensors in host memory (pinned when the device
  is CUDA, so copies to the device cache can be asynchronous), initialised like the all-resident
  table (every row by the config's ``init_fn`` at construction).
* :class:`FileRowStore` (``key_value``): one file per tensor under a directory, memory-mapped as
  fixed-size rows. The files are created sparse, so an empty table costs no disk writes and
  rows that were never written read as zeros; the table's id table reports a row's first use
  (``IdTable(report_first_use=True)``), and the row is initialised then, as a row taken from
  an evicted id is. Its pages are file-backed: the operating system keeps in memory what is
  used and writes the rest back, so a table may be larger than host memory.

Both give :class:`~recsdk.sharding.rows.tbe_views.TableViews` over all rows of the shard
(``weight [rows, dim]`` and each per-row state, shaped as the kernel's with the shard's rows):
the cache copies rows between them and the kernel's views, and checkpoints and export read and
write them as they read an all-resident kernel.
"""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path

import torch

from recsdk.sharding.rows.tbe_views import TableViews

__all__ = ["FileRowStore", "HostRowStore", "RowStore", "check_store_directory", "create_store", "store_directory"]

_PAGE = 4096  # a first write into a sparse file allocates a page

LOCAL_RANK_TOKEN = "@local_rank"
"""TorchRec's placeholder in ``KeyValueParams.ssd_storage_directory``, replaced by the local rank."""


class RowStore:
    """Every row of one table shard, with its per-row optimizer state.

    Args:
        views (TableViews): ``weight [rows, dim]`` and the per-row states, all rows.
        kind (str): ``"host"`` or ``"file"``.
        lazy_init (bool): rows are initialised at their first use, not at construction.
    """

    def __init__(self, views: TableViews, kind: str, lazy_init: bool) -> None:
        self.views = views
        self.kind = kind
        self.lazy_init = lazy_init

    @property
    def rows(self) -> int:
        """Rows of the shard."""
        return int(self.views.weight.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the rows and their optimizer state."""
        return sum(t.numel() * t.element_size() for t in (self.views.weight, *self.views.states))

    def check_room(self, num_rows: int) -> None:
        """Raise unless a batch of (at most) ``num_rows`` distinct rows can be written (host memory: always)."""

    def staging(self) -> TableViews:
        """New, uninitialised tensors shaped as :attr:`views` (a checkpoint load reads into them
        before it commits); in host memory here."""
        return TableViews(torch.empty_like(self.views.weight), [torch.empty_like(s) for s in self.views.states])


def _row_shapes(rows: int, kernel: TableViews) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of the weight and each per-row state of a shard of ``rows`` rows."""
    return [((rows, *t.shape[1:]), t.dtype) for t in (kernel.weight, *kernel.states)]


class HostRowStore(RowStore):
    """A table shard's rows in host memory (``fused_uvm_caching``).

    Args:
        rows (int): rows of the shard.
        kernel (TableViews): the table's views in the fused kernel (the cache): their dtypes and
            row shapes are the store's.
        pin (bool): page-locked memory (a CUDA device cache copies from it asynchronously).

    Example::

        store = HostRowStore(1_000_000, kernel_views["user"], pin=False)
        init_rows_(store.views.weight, torch.arange(store.rows), config)
    """

    def __init__(self, rows: int, kernel: TableViews, *, pin: bool) -> None:
        tensors = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for shape, dtype in _row_shapes(rows, kernel)]
        super().__init__(TableViews(tensors[0], tensors[1:]), "host", lazy_init=False)


class FileRowStore(RowStore):
    """A table shard's rows in memory-mapped files under ``directory`` (``key_value``).

    One file per tensor (``<name>.weight``, ``<name>.state<i>``), created sparse at the full
    size (existing files of that name are replaced: a store starts empty; a checkpoint load
    refills it). The space the files may take is checked against the file system's free space
    at construction; it is not reserved.

    Args:
        rows (int): rows of the shard.
        kernel (TableViews): the table's views in the fused kernel (dtypes and row shapes).
        directory (Path): an existing, writable directory (:func:`check_store_directory`).
        name (str): the files' stem (unique per table shard in the directory).
        table (str): the user's table name, for errors.

    Raises:
        ValueError: the directory cannot hold the files (names the table, path, bytes needed
            and free).

    Example::

        store = FileRowStore(100_000_000, kernel_views["item"], directory=Path("/ssd/rank0"),
                             name="item", table="item")
    """

    def __init__(self, rows: int, kernel: TableViews, *, directory: Path, name: str, table: str) -> None:
        shapes = _row_shapes(rows, kernel)
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in shapes]
        need = sum(sizes)
        free = free_bytes(directory)
        if need > free:
            raise ValueError(
                f"table {table!r}: its row store needs {need} bytes under {str(directory)!r}, which has {free} "
                "free; free space there, choose another ssd_storage_directory, or raise the cache's share "
                "(cache_params.load_factor does not shrink the store)"
            )
        tensors = []
        for i, ((shape, dtype), nbytes) in enumerate(zip(shapes, sizes, strict=True)):
            path = directory / (f"{name}.weight" if i == 0 else f"{name}.state{i - 1}")
            with open(path, "wb") as f:  # truncates an old store of the same name
                f.truncate(nbytes)  # sparse: no block is written
            flat = torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype)
            tensors.append(flat.view(shape))
        super().__init__(TableViews(tensors[0], tensors[1:]), "file", lazy_init=True)
        self.directory = directory
        self._name = name
        self._table = table

    def check_room(self, num_rows: int) -> None:
        """Raise unless the file system has room for what a batch of (at most) ``num_rows`` distinct rows may
        write: each row initialised at first use and, once evicted, another row written back, in
        every file (a write into a sparse file with no room left would kill the process with
        ``SIGBUS`` instead). The host stage checks this, where a failure is agreed across ranks.

        Raises:
            OSError: ``ENOSPC``, naming the table, the directory, the bytes free and needed.
        """
        row_bytes = sum(t[0].numel() * t.element_size() + _PAGE for t in (self.views.weight, *self.views.states))
        need = 2 * num_rows * row_bytes
        free = free_bytes(self.directory)
        if need > free:
            raise OSError(
                errno.ENOSPC,
                f"table {self._table!r}: its row store under {str(self.directory)!r} has {free} bytes free, and a "
                f"batch may write up to {need}; free space there (the store's files are sparse: they take disk "
                "as rows are written)",
            )

    def staging(self) -> TableViews:
        """Staging tensors in files beside the store's (the table may be larger than memory),
        unlinked once mapped: their space is freed with the tensors.

        Raises:
            ValueError: the directory has not the room for them (names the table and path).
        """
        free = free_bytes(self.directory)
        if self.nbytes > free:
            raise ValueError(
                f"table {self._table!r}: loading its row store needs {self.nbytes} bytes of staging space under "
                f"{str(self.directory)!r}, which has {free} free"
            )
        tensors = []
        for i, t in enumerate((self.views.weight, *self.views.states)):
            path = self.directory / f".{self._name}.staging{i}.{os.getpid()}"
            with open(path, "wb") as f:
                f.truncate(t.numel() * t.element_size())
            try:
                tensors.append(torch.from_file(str(path), shared=True, size=t.numel(), dtype=t.dtype).view(t.shape))
            finally:
                path.unlink()
        return TableViews(tensors[0], tensors[1:])


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still take on the file system of ``directory``."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def store_directory(configured: str, *, rank: int, local_rank: int) -> Path:
    """The directory of this rank's file stores, from ``KeyValueParams.ssd_storage_directory``.

    TorchRec's ``@local_rank`` placeholder is replaced by the local rank (the user gives one
    directory per rank); without it each rank uses its own ``rank<r>`` subdirectory, created
    if needed.

    Args:
        configured (str): the configured directory.
        rank (int): this rank.
        local_rank (int): this rank on its node.
    """
    if LOCAL_RANK_TOKEN in configured:
        return Path(configured.replace(LOCAL_RANK_TOKEN, str(local_rank)))
    return Path(configured) / f"rank{rank}"


def check_store_directory(table: str, configured: str, directory: Path) -> None:
    """Raise unless ``directory`` exists (or can be made under an existing directory) and is writable.

    Args:
        table (str): the table, for the message.
        configured (str): the directory as configured (the message names it).
        directory (Path): this rank's directory (:func:`store_directory`).

    Raises:
        ValueError: names the table, the configured path and what is wrong.
    """
    base = Path(configured.split(LOCAL_RANK_TOKEN, 1)[0]) if LOCAL_RANK_TOKEN in configured else Path(configured)
    if LOCAL_RANK_TOKEN not in configured and not base.is_dir():
        raise ValueError(
            f"table {table!r}: key_value_params.ssd_storage_directory {configured!r} does not exist or is not a "
            "directory; create it (each rank stores its rows in a rank<r> subdirectory)"
        )
    if LOCAL_RANK_TOKEN not in configured and not directory.exists():
        directory.mkdir()
    if not directory.is_dir():
        raise ValueError(
            f"table {table!r}: key_value_params.ssd_storage_directory {configured!r} gives {str(directory)!r} on "
            "this rank, which does not exist or is not a directory; create it"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(
            f"table {table!r}: the row store directory {str(directory)!r} (ssd_storage_directory {configured!r}) "
            "is not writable"
        )


def create_store(
    store: str, rows: int, kernel: TableViews, *, table: str, directory: str | None, rank: int, name: str, pin: bool
) -> RowStore:
    """The row store of one cached table shard on this rank.

    Args:
        store (str): ``"host"`` or ``"file"``.
        rows (int): rows of the shard.
        kernel (TableViews): the table's views in the fused kernel.
        table (str): the user's table name.
        directory (str | None): ``ssd_storage_directory`` as configured (``"file"``).
        rank (int): this rank (its directory, see :func:`store_directory`).
        name (str): the files' stem.
        pin (bool): page-locked host memory (``"host"`` behind a CUDA cache).

    Raises:
        ValueError: the directory is missing, not writable or too small (names table and path).
    """
    if store == "host":
        return HostRowStore(rows, kernel, pin=pin)
    assert directory is not None
    path = store_directory(directory, rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", rank)))
    check_store_directory(table, directory, path)
    return FileRowStore(rows, kernel, directory=path, name=name, table=table)
