"""``inspect_root``: what a publisher's root holds, and whether it serves (``python -m recsdk.serving
inspect ROOT``, in ``cli.py``).

Prints one line per complete version (kind, parent, step, bytes, per table the ids written and
deleted; ``UNREADABLE`` and why for a version whose manifest cannot be read or is refused), then
whether the chain a server applies (the latest full version and every delta after it, as
:func:`~recsdk.embedding.publication_chain.plan_chain` plans it for
:class:`~recsdk.serving.ServingModel`) is complete and intact: every version present and
readable, each manifest's own CRC-32, each delta on top of the very version it was published on,
every file's size and CRC-32 as its manifest recorded, no symbolic link. Never a traceback: any
failure is a ``BROKEN`` line and exit status 1.
"""

from __future__ import annotations

import os

from recsdk.embedding import PublicationError, read_version
from recsdk.embedding.publication_chain import plan_chain

__all__ = ["inspect_root"]


def inspect_root(root: str | os.PathLike[str]) -> tuple[list[str], bool]:
    """The report's lines and whether the chain from the latest full version is complete and intact.

    Args:
        root (str | os.PathLike): the publisher's root.

    Returns:
        tuple[list[str], bool]: the lines to print; True when a server can apply the latest version.
    """
    root = os.fspath(root)
    plan = plan_chain(root)
    versions, manifests = plan.versions, plan.manifests
    if not versions:
        return [f"{root}: no complete version"], False
    tables = sorted({name for m in manifests.values() for name in m["tables"]})
    lines = [f"{root}: {len(versions)} complete versions, {versions[0]} to {versions[-1]}"]
    header = f"{'version':>8}  {'kind':<5}  {'parent':>6}  {'step':>8}  {'MB':>9}  " + "  ".join(
        f"{name + ' ids/deleted':>24}" for name in tables
    )
    lines.append(header)
    for v in versions:
        if v in plan.unreadable:
            lines.append(f"{v:>8}  UNREADABLE: {plan.unreadable[v]}")
            continue
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
    if not plan.chain:
        lines.append("chain: BROKEN: " + "; ".join(plan.problems) + ": nothing can be served from this root")
        return lines, False
    start, problems = plan.chain[0], list(plan.problems)
    for v in plan.chain:
        if v not in manifests:
            continue
        try:
            read_version(root, v)  # sizes and checksums of every file, no symbolic link
        except PublicationError as e:
            problems.append(str(e))
    if problems:
        lines.append(f"chain {start} -> {plan.chain[-1]}: BROKEN: " + "; ".join(problems))
        return lines, False
    lines.append(f"chain {start} -> {plan.chain[-1]}: complete and intact (every manifest's and file's CRC-32 checked)")
    return lines, True
