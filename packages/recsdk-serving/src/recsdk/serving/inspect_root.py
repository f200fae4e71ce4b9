"""``python -m recsdk.serving inspect ROOT``: what a publisher's root holds, and whether it serves.

Prints one line per complete version (kind, parent, step, bytes, per table the ids written and
deleted), then whether the chain a server applies (the latest full version and every delta after
it) is complete and intact: every version present, each delta on top of its parent, every file's
size and CRC-32 as its manifest recorded.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from recsdk.embedding import PublicationError, list_versions, read_version
from recsdk.embedding.publication import read_manifest

__all__ = ["inspect_root", "main"]


def inspect_root(root: str | os.PathLike[str]) -> tuple[list[str], bool]:
    """The report's lines and whether the chain from the latest full version is complete and intact.

    Args:
        root (str | os.PathLike): the publisher's root.

    Returns:
        tuple[list[str], bool]: the lines to print; True when a server can apply the latest version.
    """
    root = os.fspath(root)
    versions = list_versions(root)
    if not versions:
        return [f"{root}: no complete version"], False
    manifests = {v: read_manifest(root, v) for v in versions}
    tables = sorted({name for m in manifests.values() for name in m["tables"]})
    lines = [f"{root}: {len(versions)} complete versions, {versions[0]} to {versions[-1]}"]
    header = f"{'version':>8}  {'kind':<5}  {'parent':>6}  {'step':>8}  {'MB':>9}  " + "  ".join(
        f"{name + ' ids/deleted':>24}" for name in tables
    )
    lines.append(header)
    for v in versions:
        m = manifests[v]
        size = sum(int(f["size"]) for f in m["files"].values()) / 1e6
        counts = "  ".join(
            f"{m['tables'][name]['upserted']:>14,}/{m['tables'][name]['deleted']:<9,}"
            if name in m["tables"]
            else " " * 24
            for name in tables
        )
        parent = "-" if m["parent"] is None else str(m["parent"])
        lines.append(f"{v:>8}  {m['kind']:<5}  {parent:>6}  {m['step']:>8}  {size:>9.2f}  {counts}")
    fulls = [v for v in versions if manifests[v]["kind"] == "full"]
    if not fulls:
        lines.append("chain: no full version: nothing can be served from this root")
        return lines, False
    start, problems = fulls[-1], []
    for v in range(start, versions[-1] + 1):
        if v not in manifests:
            problems.append(f"version {v} is missing")
            continue
        if v > start and manifests[v]["parent"] != v - 1:
            problems.append(f"version {v} applies on top of {manifests[v]['parent']}, not {v - 1}")
        try:
            read_version(root, v)  # sizes and checksums of every file
        except PublicationError as e:
            problems.append(str(e))
    if problems:
        lines.append(f"chain {start} -> {versions[-1]}: BROKEN: " + "; ".join(problems))
        return lines, False
    lines.append(f"chain {start} -> {versions[-1]}: complete and intact (every file's size and CRC-32 checked)")
    return lines, True


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``inspect ROOT``; exit status 1 when the chain is not servable."""
    parser = argparse.ArgumentParser(prog="python -m recsdk.serving", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="list a publisher's versions and check the chain a server applies")
    inspect.add_argument("root", help="the publisher's root")
    args = parser.parse_args(argv)
    lines, ok = inspect_root(args.root)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
