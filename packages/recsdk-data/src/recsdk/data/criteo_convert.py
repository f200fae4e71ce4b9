"""Converting Criteo TSV files into recsdk's columnar format, in parallel and resumably.

:func:`convert_criteo` (on the command line ``python -m recsdk.data.convert criteo IN... OUT``):
the inputs (plain or ``.gz``, days in order) become ``OUT``, a folder that :class:`~recsdk.data.ColumnarDataset` reads
(format: :mod:`recsdk.data.columnar_format`). Each line is parsed exactly as
:class:`~recsdk.data.CriteoDataset` parses it (hex ids parsed once, an empty field is no id,
bad lines raise naming file and line or are skipped and counted).

**Units of work.** A plain file is cut at line ends into ranges of about ``chunk_bytes``; a
compressed file is one unit (it can only be read from its start). Units run on ``workers``
processes, each writing one part file (record batches of up to ``rows_per_batch`` rows),
flushed and renamed into place, then a marker saying it is done. The manifest is written
last, so ``OUT`` is a dataset only once every unit is done.

**Resuming.** ``OUT/.convert/plan.json`` records the inputs (path, size, modification time)
and the options. Run again with the same inputs and options, a conversion that was killed
keeps its finished units and does the rest; other inputs or options raise ``ValueError``
naming each difference (``overwrite=True`` / ``--overwrite`` starts over).

**One conversion per folder.** A conversion holds an exclusive lock on ``OUT/.convert.lock``
(``flock``, released when the process ends, however it ends) from before it looks at ``OUT``;
a second conversion into the same folder fails at once with ``BlockingIOError`` naming the
first (its process id, host, start time and command line, as the lock file records them).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import multiprocessing as mp
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from recsdk.data._checks import check_bool, check_choice, check_int, check_paths
from recsdk.data.columnar_format import (
    FORMAT,
    FORMAT_VERSION,
    ID_TYPES,
    MANIFEST,
    IdsTooWide,
    columnar_schema,
    read_manifest,
    record_batch,
)
from recsdk.data.columnar_format import write_json_atomically as _write_json
from recsdk.data.criteo_fields import CRITEO_DENSE_COLUMNS, CRITEO_SPARSE_FEATURES, ON_BAD_LINE, CriteoRows
from recsdk.data.criteo_tsv import BadLines, read_criteo_tsv

__all__ = ["convert_criteo"]

_WORK = ".convert"  # the conversion's own bookkeeping inside OUT
_LOCK = ".convert.lock"  # held by the conversion running into OUT (never removed: removing it would race)
_COMPRESSED = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}  # what pyarrow's CSV reader detects
_SEARCH = 1 << 20  # bytes read at a time when looking for a line end
_BYTES_PER_PROCESS = 512 << 20  # input per worker process when the caller leaves the count to us


def _part_name(unit: int) -> str:
    return f"part-{unit:05d}.arrow"


def _partial(part: Path) -> Path:
    """Where a part is written before it is renamed into place."""
    return part.with_name(part.name + ".tmp")


def _marker(out: Path, unit: int) -> Path:
    return out / _WORK / f"unit-{unit:05d}.json"


def _line_end_after(path: Path, position: int, size: int) -> int:
    """The offset just past the first ``\\n`` at or after ``position`` (``size`` if none)."""
    with open(path, "rb") as f:
        f.seek(position)
        while position < size:
            block = f.read(_SEARCH)
            i = block.find(b"\n")
            if i >= 0:
                return position + i + 1
            position += len(block)
    return size


def _plan(paths: list[Path], chunk_bytes: int, on_bad_line: str, rows_per_batch: int) -> dict[str, Any]:
    """Inputs, options and units (``[source, start, end]``; ``start`` is ``None`` for a compressed file)."""
    sources, units = [], []
    for i, path in enumerate(paths):
        stat = path.stat()
        sources.append({"path": str(path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns})
        if path.suffix in _COMPRESSED:
            units.append([i, None, stat.st_size])
            continue
        start = 0
        while start < stat.st_size:
            end = _line_end_after(path, min(start + chunk_bytes, stat.st_size), stat.st_size)
            units.append([i, start, end])
            start = end
    options = {"on_bad_line": on_bad_line, "rows_per_batch": rows_per_batch, "chunk_bytes": chunk_bytes}
    return {"kind": "criteo", "sources": sources, "options": options, "units": units}


def _plan_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two plans, in words (empty when the same)."""
    differ = []
    old_paths = [s["path"] for s in old.get("sources", [])]
    new_paths = [s["path"] for s in new["sources"]]
    if old_paths != new_paths:
        differ.append(f"inputs {old_paths} -> {new_paths}")
    else:
        for a, b in zip(old["sources"], new["sources"], strict=True):
            for key in ("bytes", "mtime_ns"):
                if a[key] != b[key]:
                    differ.append(f"{b['path']} {key} {a[key]} -> {b[key]} (the file changed)")
    for key, value in new["options"].items():
        if old.get("options", {}).get(key) != value:
            differ.append(f"{key} {old.get('options', {}).get(key)!r} -> {value!r}")
    return differ


def _lines_before(path: Path, offset: int) -> int:
    """Line ends in the first ``offset`` bytes of a plain file."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            block = f.read(min(_SEARCH * 16, offset))
            if not block:
                break
            count += block.count(b"\n")
            offset -= len(block)
    return count


_REPORT: Callable[[int], None] | None = None  # a worker process's progress channel


def _init_worker(queue: Any) -> None:
    global _REPORT
    _REPORT = queue.put


def _convert_unit(out: str, unit: int, spec: list[Any], source: str, options: dict[str, Any]) -> dict[str, Any]:
    """Convert one unit into its part file and mark it done; returns its rows, bad lines, bytes and id type.

    The ids are written as ``uint32``; a unit holding an id outside ``[0, 2**32)`` is written
    again with ``int64`` ids (its progress taken back first).
    """
    report = _REPORT or (lambda _: None)
    part = Path(out) / _part_name(unit)
    done = 0  # input bytes of the unit reported as converted

    def advance(position: int) -> None:
        nonlocal done
        report(position - done)
        done = position

    for id_type in ID_TYPES:
        try:
            rows, bad_lines = _write_part(part, spec, source, options, id_type, advance)
            break
        except IdsTooWide:
            advance(0)  # the unit is written again
            if id_type == "int64":
                raise
    os.replace(_partial(part), part)
    _, start, end = spec
    advance(end - (start or 0))  # the rest of the unit's bytes
    result = {"rows": rows, "bad_lines": bad_lines, "bytes": part.stat().st_size, "ids": id_type}
    _write_json(_marker(Path(out), unit), result)
    return result


def _write_part(
    part: Path, spec: list[Any], source: str, options: dict[str, Any], id_type: str, advance: Callable[[int], None]
) -> tuple[int, int]:
    """Parse one unit into ``part``'s partial file (flushed) with ids of ``id_type``; returns rows and bad lines.

    ``advance(position)`` is told the input bytes of the unit consumed so far.
    """
    path, (_, start, end) = Path(source), spec
    raw: pa.NativeFile
    if start is None:
        raw = pa.OSFile(source)
        stream: pa.NativeFile = pa.CompressedInputStream(raw, _COMPRESSED[path.suffix])
    else:
        raw = stream = pa.BufferReader(pa.memory_map(source, "r").read_at(end - start, start))
    bad = BadLines(options["on_bad_line"], line_base=(lambda: _lines_before(path, start) + 1) if start else None)
    schema = columnar_schema(len(CRITEO_DENSE_COLUMNS), CRITEO_SPARSE_FEATURES, id_type)
    tmp = _partial(part)
    limit, rows, pending, held = options["rows_per_batch"], 0, [], 0
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:

        def write(block: CriteoRows) -> None:
            writer.write_batch(record_batch(schema, *block.arrays()))

        with stream:
            for block in read_criteo_tsv(stream, path, bad, block_size=options["block_size"]):
                pending.append(block)
                held += len(block)
                if held >= limit:
                    joined = CriteoRows.concat(pending)
                    for first in range(0, held - limit + 1, limit):
                        write(joined.take(slice(first, first + limit)))
                    kept = held % limit
                    pending, held = ([joined.take(slice(held - kept, held))] if kept else []), kept
                rows += len(block)
                advance(raw.tell())  # input bytes consumed (compressed bytes for a compressed file)
            if pending:
                write(CriteoRows.concat(pending))
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    return rows, bad.count


def _prepare(out: Path, plan: dict[str, Any], overwrite: bool) -> None:
    """Make ``out`` ready for ``plan``: new, resumed (same plan), or cleared (another plan and ``overwrite``)."""
    work = out / _WORK
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {str(out)!r} exists and is not a folder")
    ours = work.is_dir() or (out / MANIFEST).is_file()
    if out.is_dir() and any(child.name != _LOCK for child in out.iterdir()) and not ours:
        raise ValueError(f"output folder {str(out)!r} holds other files: give an empty or new folder")
    if ours:
        recorded = work / "plan.json"
        old = json.loads(recorded.read_text()) if recorded.is_file() else None
        differ = _plan_differences(old, plan) if old is not None else ["it has no conversion plan"]
        if differ and not overwrite:
            raise ValueError(
                f"{str(out)!r} holds a conversion of other inputs or options: {'; '.join(differ)}; give another "
                "output folder, the same inputs and options to resume, or overwrite=True (--overwrite) to start over"
            )
        if differ:
            for child in out.iterdir():
                if child.name in (MANIFEST, _WORK) or child.name.startswith("part-"):
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
    work.mkdir(parents=True, exist_ok=True)
    _write_json(work / "plan.json", plan)


def convert_criteo(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    workers: int | None = None,
    on_bad_line: str = "error",
    rows_per_batch: int = 1 << 18,
    chunk_bytes: int = 256 << 20,
    block_size: int = 1 << 22,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Convert Criteo TSV files (plain or compressed, in order) into a columnar dataset folder.

    Args:
        inputs (str | os.PathLike | Sequence): one file or a list, in line order.
        out (str | os.PathLike): the dataset folder to write (new, empty, or a conversion
            of the same inputs to resume).
        workers (int | None): processes converting units in parallel (>= 1); ``None``: the
            CPU count, at most the number of units and one per ``_BYTES_PER_PROCESS`` (512 MiB)
            of input left (a process costs seconds to start). ``1`` converts in this process.
        on_bad_line (str): ``"error"`` (raise ``ValueError`` naming file and line) or
            ``"skip"`` (leave the line out; the manifest counts them).
        rows_per_batch (int): rows per record batch of a part file (>= 1).
        chunk_bytes (int): bytes of a plain file per unit of work (>= 1).
        block_size (int): bytes the CSV parser reads at a time (>= 1024).
        overwrite (bool): replace a conversion of other inputs or options in ``out``.
        progress (bool): show a progress bar (tqdm) of the input bytes done.

    Returns:
        dict: the manifest written to ``out/manifest.json``.

    Raises:
        FileNotFoundError: an input file is missing.
        ValueError: a bad line with ``on_bad_line="error"`` (``file:line``, the line's number in
            that file), or ``out`` holds other files or another conversion (each difference named).
        BlockingIOError: another conversion is running into ``out`` (named).
        OSError: an input cannot be read or is corrupt (e.g. a damaged ``.gz``), naming the file.

    Example::

        manifest = convert_criteo(["day_0.gz", "day_1.gz"], "criteo_columnar", on_bad_line="skip")
        ds = ColumnarDataset("criteo_columnar", batch_size=4096)
    """
    paths = check_paths(inputs)
    if not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"out must be a str or os.PathLike, got {type(out).__name__} {out!r}")
    if workers is not None:
        check_int("workers", workers, minimum=1)
    check_choice("on_bad_line", on_bad_line, ON_BAD_LINE)
    check_int("rows_per_batch", rows_per_batch, minimum=1)
    check_int("chunk_bytes", chunk_bytes, minimum=1)
    check_int("block_size", block_size, minimum=1024)
    check_bool("overwrite", overwrite)
    check_bool("progress", progress)
    root = Path(out)
    plan = _plan(paths, chunk_bytes, on_bad_line, rows_per_batch)
    if root.exists() and not root.is_dir():
        raise ValueError(f"output {str(root)!r} exists and is not a folder")
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root):
        _prepare(root, plan, overwrite)
        if (root / MANIFEST).is_file():
            return read_manifest(root)
        return _convert(root, plan, workers, block_size, progress)


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Hold ``out``'s conversion lock (see the module); raise ``BlockingIOError`` naming its holder."""
    path = out / _LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "a process that has not said which"
            raise BlockingIOError(
                errno.EWOULDBLOCK,
                f"output folder {str(out)!r} is being converted into by another conversion ({holder}); wait for it "
                "to end or give another folder",
            ) from None
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {started}: {' '.join(sys.argv)}".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _convert(root: Path, plan: dict[str, Any], workers: int | None, block_size: int, progress: bool) -> dict[str, Any]:
    """Convert the units not done yet (under the lock); write and return the manifest."""
    results: dict[int, dict[str, Any]] = {}
    todo = []
    for unit in range(len(plan["units"])):
        marker, part = _marker(root, unit), root / _part_name(unit)
        if marker.is_file() and part.is_file():
            done = json.loads(marker.read_text())
            if done.get("ids") in ID_TYPES and done["bytes"] == part.stat().st_size:
                results[unit] = done
                continue
        for stale in (marker, part, _partial(part)):
            stale.unlink(missing_ok=True)
        todo.append(unit)
    options = {**plan["options"], "block_size": block_size}
    unit_bytes = [end - (start or 0) for _, start, end in plan["units"]]
    bar = _progress_bar(progress, sum(unit_bytes), sum(unit_bytes[u] for u in results))
    started = time.perf_counter()
    try:
        if workers is None:
            left = sum(unit_bytes[u] for u in todo)
            workers = min(os.cpu_count() or 1, max(1, -(-left // _BYTES_PER_PROCESS)))
        n = min(workers, max(len(todo), 1))
        args = [(str(root), u, plan["units"][u], plan["sources"][plan["units"][u][0]]["path"], options) for u in todo]
        if n == 1:
            global _REPORT
            _REPORT = bar.update if bar is not None else None
            try:
                for a in args:
                    results[a[1]] = _convert_unit(*a)
            finally:
                _REPORT = None
        else:
            results.update(_run_pool(n, args, bar))
    finally:
        if bar is not None:
            bar.close()
    manifest = _manifest(root, plan, results)
    _write_json(root / MANIFEST, manifest)
    manifest["seconds"] = time.perf_counter() - started
    return manifest


def _progress_bar(show: bool, total: int, initial: int) -> Any:
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="B", unit_scale=True, desc="convert", file=sys.stderr)


def _run_pool(n: int, args: list[tuple[Any, ...]], bar: Any) -> dict[int, dict[str, Any]]:
    """Run the units on ``n`` processes; the first failure stops all of them and is raised."""
    # No fork: the parent may hold threads (pyarrow's, torch's). A fork server starts clean, imports
    # this module once, and forks the workers from there (spawn would import it in every worker).
    if "forkserver" in mp.get_all_start_methods():
        ctx: Any = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
    else:
        ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    results: dict[int, dict[str, Any]] = {}
    with ctx.Pool(n, initializer=_init_worker, initargs=(queue,)) as pool:
        pending = {a[1]: pool.apply_async(_convert_unit, a) for a in args}
        try:
            while pending:
                while not queue.empty():
                    delta = queue.get()
                    if bar is not None:
                        bar.update(delta)
                for unit in [u for u, r in pending.items() if r.ready()]:
                    results[unit] = pending.pop(unit).get()  # raises the worker's error
                time.sleep(0.05)
        except BaseException:
            pool.terminate()
            raise
    while bar is not None and not queue.empty():
        bar.update(queue.get())
    return results


def _manifest(root: Path, plan: dict[str, Any], results: dict[int, dict[str, Any]]) -> dict[str, Any]:
    schema = columnar_schema(len(CRITEO_DENSE_COLUMNS), CRITEO_SPARSE_FEATURES)
    types = {f.name: str(f.type) for f in schema}
    types.update({name: "list<item: uint32 or int64, as the part's ids>" for name in CRITEO_SPARSE_FEATURES})
    sources = [{"path": s["path"], "bytes": s["bytes"], "rows": 0, "bad_lines": 0} for s in plan["sources"]]
    parts = []
    for unit, (source, start, end) in enumerate(plan["units"]):
        done = results[unit]
        sources[source]["rows"] += done["rows"]
        sources[source]["bad_lines"] += done["bad_lines"]
        span = None if start is None else [start, end]
        parts.append(
            {
                "file": _part_name(unit),
                "rows": done["rows"],
                "bytes": done["bytes"],
                "ids": done["ids"],
                "source": source,
                "byte_range": span,
            }
        )
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": "criteo",
        "rows": sum(p["rows"] for p in parts),
        "bad_lines": sum(s["bad_lines"] for s in sources),
        "on_bad_line": plan["options"]["on_bad_line"],
        "label": "label",
        "dense": {"column": "dense", "names": CRITEO_DENSE_COLUMNS, "transform": "log(1 + max(x, 0)), 0 when empty"},
        "sparse": CRITEO_SPARSE_FEATURES,
        "schema": [{"name": name, "type": kind} for name, kind in types.items()],
        "rows_per_batch": plan["options"]["rows_per_batch"],
        "sources": sources,
        "parts": parts,
    }
