"""``plan_chain``: which versions a server applies next, the one answer for serving and inspection.

A server applies the latest full version newer than what it serves (if any), then every delta
after it, each on top of its parent: the version it was published on top of, as the delta's
``parent_manifest_crc32`` records it (see :mod:`recsdk.embedding.publication`). Every manifest
is read and checked (:func:`~recsdk.embedding.publication.read_manifest`); a version whose
manifest cannot be read is reported by name as unreadable and stops the chain where the chain
needs it. :class:`~recsdk.serving.ServingModel` applies what this plans and
``python -m recsdk.serving inspect`` reports it, so they agree on every root.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from recsdk.embedding.publication import PublicationError, check_parent, list_versions, read_manifest

__all__ = ["ChainPlan", "plan_chain"]


@dataclass
class ChainPlan:
    """What :func:`plan_chain` found.

    Attributes:
        versions (list[int]): every version listed under the root, ascending.
        manifests (dict[int, dict]): the manifests read and checked, by version.
        unreadable (dict[int, str]): the versions whose manifest could not be read or was refused,
            and why (naming the version and file).
        chain (list[int]): the versions a server would apply, in order (the latest full one
            among them first, if any).
        apply (list[int]): the leading part of ``chain`` that can be applied (up to the first problem).
        problems (list[str]): what stops the rest of ``chain`` (missing, unreadable, a delta not
            on top of the version before it); empty when all of it applies.
    """

    versions: list[int]
    manifests: dict[int, dict[str, Any]]
    unreadable: dict[int, str]
    chain: list[int]
    apply: list[int]
    problems: list[str]


def plan_chain(root: str | os.PathLike[str], served: Mapping[str, Any] | None = None) -> ChainPlan:
    """Plan the versions to apply on top of ``served`` (a manifest; None: nothing served yet).

    Args:
        root (str | os.PathLike): the publisher's root.
        served (Mapping | None): the manifest of the version served.

    Returns:
        ChainPlan: the plan; with nothing served and no full version to start from, ``chain``
        is empty and ``problems`` says so.

    Raises:
        PublicationError: the root cannot be listed.

    Example::

        plan = plan_chain("publish/")
        plan.apply, plan.problems  # ([4, 5, 6], [])
    """
    where = os.fspath(root)
    versions = list_versions(root)
    manifests: dict[int, dict[str, Any]] = {}
    unreadable: dict[int, str] = {}
    for v in versions:
        try:
            manifests[v] = read_manifest(root, v)
        except PublicationError as e:
            unreadable[v] = str(e)
    after = -1 if served is None else int(served["version"])
    newer = [v for v in versions if v > after]
    fulls = [v for v in newer if v in manifests and manifests[v]["kind"] == "full"]
    if fulls:
        newer = [v for v in newer if v >= fulls[-1]]
    elif served is None:
        readable = [v for v in versions if v in manifests]
        problem = f"no complete full version under {where!r} (versions: {readable}"
        problem += f"; unreadable: {sorted(unreadable)})" if unreadable else ")"
        return ChainPlan(versions, manifests, unreadable, [], [], [problem])
    first = fulls[-1] if fulls else after + 1
    chain = list(range(first, newer[-1] + 1)) if newer else []
    apply: list[int] = []
    problems: list[str] = []
    previous: Mapping[str, Any] | None = None if fulls else served
    for v in chain:
        if v not in manifests:
            problems.append(unreadable.get(v) or f"version {v} is missing under {where!r}")
            previous = None
            continue
        mismatch = check_parent(manifests[v], previous)
        if mismatch:
            problems.append(mismatch)
        elif not problems:
            apply.append(v)
        previous = manifests[v]
    return ChainPlan(versions, manifests, unreadable, chain, apply, problems)
