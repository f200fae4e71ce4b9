"""Helpers for tests of code that reads publications (this package's, and recsdk-serving's).

Not used by the library itself: they forge what a hostile or damaged root holds, so that a test
can check it is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recsdk.embedding.publication import manifest_checksum

__all__ = ["edit_manifest"]


def edit_manifest(root: Path, version: int, change: Callable[[dict[str, Any]], None], *, fix_crc: bool) -> None:
    """Rewrite version ``version``'s manifest under ``root`` as ``change`` edits it in place.

    Args:
        root (Path): the publication root.
        version (int): the version whose ``manifest.json`` to edit.
        change (Callable[[dict], None]): edits the manifest's JSON object.
        fix_crc (bool): record the edited manifest's own CRC-32 in it (a forger who knows the
            format); else the old one stays (a plain edit).

    Example::

        edit_manifest(root, 1, lambda m: m.update(version=7), fix_crc=True)
    """
    path = root / f"{version:08d}" / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    if fix_crc:
        manifest["manifest_crc32"] = manifest_checksum(manifest)
    path.write_text(json.dumps(manifest))
