"""Cutting a TSV source into blocks of whole lines, where pyarrow's streaming CSV reader cuts them.

A plain file is memory-mapped and its blocks are views of the mapping; a compressed file or a
stream is read one block ahead on a helper thread (as pyarrow's own reader does), each block in
a buffer of its own. A line longer than ``block_size`` raises ``pyarrow.ArrowInvalid`` naming the
file and the block size.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa

__all__ = ["Block", "blocks"]

Block = tuple[Any, int, int]  # (bytes-like with find/rfind, start, end): whole lines of the source


def _cut(data: Any, start: int, end: int) -> int:
    """Where pyarrow's reader ends a block read up to ``end``: after its last '\\n' or '\\r' (``start`` if none)."""
    newline = data.rfind(b"\n", start, end)
    return max(newline, data.rfind(b"\r", newline + 1 if newline >= 0 else start, end)) + 1 or start


def _too_long(path: Path, block_size: int) -> pa.ArrowInvalid:
    return pa.ArrowInvalid(f"{path}: a line is longer than block_size ({block_size:,} bytes); pass a larger block_size")


def _line_start(data: Any, start: int, end: int) -> int:
    """``start``, or the byte after it where it is the '\\n' of a '\\r\\n' that a block ended inside."""
    return start + 1 if start < end and start > 0 and data[start - 1] == 13 and data[start] == 10 else start


def _mapped_blocks(path: Path, mapped: mmap.mmap, block_size: int) -> Generator[Block, None, None]:
    """Blocks of a memory-mapped file: whole lines, cut where pyarrow's reader cuts them."""
    size, start, read = len(mapped), 0, 0
    while start < size:
        window, read = read, min(read + block_size, size)  # the source is read block_size bytes at a time
        end = read if read == size else _cut(mapped, start, read)
        if end > start:
            yield mapped, start, end
            start = _line_start(mapped, end, size)
        elif start < window:  # the line began before this read and goes on past it
            raise _too_long(path, block_size)


def _stream_blocks(path: Path, stream: pa.NativeFile, block_size: int) -> Generator[Block, None, None]:
    """Blocks of a stream, each in a buffer of its own whose byte before the block is its line end."""
    held = b"\n"  # the last line end read, then the start of a line whose end is not read yet
    while True:
        buffer = bytearray(len(held) + block_size)
        buffer[: len(held)] = held
        got = stream.readinto(memoryview(buffer)[len(held) :])
        size = len(held) + got
        start = _line_start(buffer, 1, size)
        if got == 0:
            if size > start:
                yield buffer, start, size
            return
        end = _cut(buffer, start, size)
        if end == start:
            if size - start > block_size:  # the line began before this read and goes on past it
                raise _too_long(path, block_size)
            held = bytes(buffer[:size])
            continue
        held = bytes(buffer[end - 1 : size])
        yield buffer, start, end


def _read_ahead(blocks: Generator[Block, None, None]) -> Generator[Block, None, None]:
    """``blocks``, each read on a helper thread while the one before is parsed (as pyarrow's own reader does)."""
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="criteo-read") as pool:
            future = pool.submit(next, blocks, None)
            try:
                while (block := future.result()) is not None:
                    future = pool.submit(next, blocks, None)
                    yield block
            finally:
                future.cancel()  # a read already running ends before the pool does
    finally:
        blocks.close()


def blocks(source: Path | pa.NativeFile, path: Path, block_size: int) -> Generator[Block, None, None]:
    """The source's blocks: a plain file memory-mapped, a compressed file or a stream read ahead."""
    if isinstance(source, pa.NativeFile):
        yield from _read_ahead(_stream_blocks(path, source, block_size))
        return
    with pa.input_stream(str(source)) as stream:  # compressed where the name says so, as pyarrow.csv reads
        mapped = None
        if not isinstance(stream, pa.CompressedInputStream):
            with open(source, "rb") as file, contextlib.suppress(OSError, ValueError):  # an empty file, a pipe
                mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        if mapped is None:
            yield from _read_ahead(_stream_blocks(path, stream, block_size))
            return
    try:
        yield from _mapped_blocks(path, mapped, block_size)
    finally:
        with contextlib.suppress(BufferError):  # a view of it still alive: it closes when that goes
            mapped.close()
