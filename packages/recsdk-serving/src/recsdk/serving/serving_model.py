"""``ServingModel``: the user's model, served from a publisher's root, following its versions."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from recsdk.embedding import (
    HashEmbeddingBagCollection,
    HashEmbeddingCollection,
    PublicationError,
    PublishedVersion,
    read_version,
)
from recsdk.embedding.publication import describe_table, differences
from recsdk.embedding.publication_chain import plan_chain
from recsdk.serving.rw_lock import ReadWriteLock
from recsdk.serving.serving_collections import ServingEmbeddingBagCollection, ServingEmbeddingCollection

__all__ = ["ServingModel"]

_Serving = ServingEmbeddingBagCollection | ServingEmbeddingCollection
_T = TypeVar("_T")
_REFRESH_SWITCH_INTERVAL_S = 0.0002


class ServingModel:
    """A model trained by recsdk, answering predictions from the versions published under ``root``.

    One process, no process group, no sharding: ``model`` is built as for training (unsharded,
    on CPU). Each of its ``HashEmbeddingBagCollection`` / ``HashEmbeddingCollection`` modules is
    replaced by a read-only :class:`~recsdk.serving.ServingEmbeddingBagCollection` /
    :class:`~recsdk.serving.ServingEmbeddingCollection` with the same forward, and its dense
    part (every other parameter and buffer) is loaded from the publication. Construction applies
    the latest full version and every delta after it.

    A forward sees one version wholly: :meth:`refresh` reads and checks a version and prepares it
    (new id indexes; for a full version a new kernel with its rows) while forwards run, then
    swaps it in and writes a delta's rows while no forward runs (forwards share a read lock, so
    several threads predict at once). Applying a full version holds its rows twice for a while.

    Args:
        model (nn.Module): the model, built as for training; changed in place (its hash modules
            replaced, its dense part loaded) and put in eval mode.
        root (str | os.PathLike): the publisher's root.

    Raises:
        PublicationError: no complete full version under ``root``, or a damaged file (named).
        ValueError: the publication's tables or dense tensors differ from the model's (every
            difference listed), or the model holds no hash module.

    Example::

        serving = ServingModel(DLRM(tables, ...), "publish/")
        scores = serving(batch)  # model(batch) in eval mode, under torch.no_grad()
        serving.follow(interval_s=10.0)  # new versions applied in the background
    """

    def __init__(self, model: nn.Module, root: str | os.PathLike[str]) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.root = os.fspath(root)
        self.model = model
        self._lock = ReadWriteLock()
        self._refreshing = threading.Lock()
        self._version: int | None = None
        self._manifest: dict[str, Any] | None = None  # the served version's
        self._step = 0
        self._kind = ""
        self._follower: threading.Thread | None = None
        self._stop = threading.Event()
        self.last_error: BaseException | None = None
        """The last error of a background refresh (:meth:`follow`), None after a good one."""
        hash_modules = {
            fqn: m
            for fqn, m in model.named_modules()
            if isinstance(m, HashEmbeddingBagCollection | HashEmbeddingCollection)
        }
        if not hash_modules:
            raise ValueError("the model holds no HashEmbeddingBagCollection or HashEmbeddingCollection to serve")
        self._tables = {cfg.name: describe_table(fqn, cfg) for fqn, m in hash_modules.items() for cfg in _configs(m)}
        prefixes = tuple(f"{fqn}." if fqn else "" for fqn in hash_modules)
        self._dense_shapes = {
            key: list(value.shape) for key, value in model.state_dict().items() if not key.startswith(prefixes)
        }
        start = self._chain_start()
        first = self._read(start)
        self._collections: dict[str, _Serving] = {}
        for fqn, module in hash_modules.items():
            serving: _Serving = (
                ServingEmbeddingBagCollection(module, first.dtype)
                if isinstance(module, HashEmbeddingBagCollection)
                else ServingEmbeddingCollection(module, first.dtype)
            )
            _replace(model, fqn, serving)
            self._collections[fqn] = serving
        model.eval()
        self._apply(first)
        self.refresh()

    @property
    def version(self) -> int:
        """The version served."""
        assert self._version is not None
        return self._version

    @property
    def step(self) -> int:
        """The training step the version served was published at."""
        return self._step

    @property
    def kind(self) -> str:
        """The kind of the version last applied: ``"full"`` or ``"delta"``."""
        return self._kind

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """``model(*inputs, **kwargs)`` in eval mode under ``torch.no_grad()``, on one version.

        Raises:
            ValueError, TypeError: a serving collection refused its batch (see
                :func:`~recsdk.serving.batch_checks.check_batch`; the features and the numbers
                named); nothing changed and no FBGEMM kernel ran on it.
        """
        with self._lock.reading(), torch.no_grad():
            return self.model(*inputs, **kwargs)

    def on_one_version(self, fn: Callable[..., _T], *args: Any) -> tuple[int, _T]:
        """``fn(model, *args)`` on one version, and that version: ``(version, result)``.

        ``fn`` gets the model (eval mode, under ``torch.no_grad()``) and may call it several
        times; no version is committed meanwhile, so the version returned is the one every call
        saw (a server names it in its answer).

        Example::

            version, scores = serving.on_one_version(lambda model, b: model(b)[1], batch)
        """
        with self._lock.reading(), torch.no_grad():
            assert self._version is not None
            return self._version, fn(self.model, *args)

    def refresh(self, max_versions: int | None = None) -> int:
        """Apply every newer complete version, in order; returns how many were applied.

        A newer full version is applied first (the deltas before it are not needed), then each
        delta after it on top of its parent: the very version it was published on top of (its
        manifest's CRC-32, as the delta records it). A version already applied is never applied
        again. What is applied is what ``python -m recsdk.serving inspect`` reports as the chain
        (:func:`~recsdk.embedding.publication_chain.plan_chain`).

        Args:
            max_versions (int | None): apply at most this many (the oldest first); None: all.

        Raises:
            PublicationError: once the versions before it are applied: a missing or unreadable
                version (named), a delta not on top of the version served, or a damaged, foreign
                or symlinked file; the model keeps serving the last version it applied.
        """
        with self._refreshing, _short_switch_interval():
            plan = plan_chain(self.root, self._manifest)
            versions = plan.apply if max_versions is None else plan.apply[:max_versions]
            for v in versions:
                published = self._read(v)
                if published.manifest["manifest_crc32"] != plan.manifests[v]["manifest_crc32"]:
                    raise PublicationError(
                        f"version {v} under {self.root!r} was replaced while it was read; the model keeps "
                        f"serving version {self._version}"
                    )
                self._apply(published)
            if plan.problems and len(versions) == len(plan.apply):
                raise PublicationError(
                    "; ".join(plan.problems) + f"; the model keeps serving version {self._version} until a full "
                    "version is published"
                )
            return len(versions)

    def follow(self, interval_s: float = 10.0) -> None:
        """Refresh every ``interval_s`` seconds on a background thread until :meth:`stop`; its
        last error is kept in :attr:`last_error` (the model keeps serving what it had)."""
        if isinstance(interval_s, bool) or not isinstance(interval_s, int | float) or interval_s <= 0:
            raise ValueError(f"interval_s must be a number > 0, got {interval_s!r}")
        if self._follower is not None and self._follower.is_alive():
            raise RuntimeError("this ServingModel already follows its root; stop() first")
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.refresh()
                    self.last_error = None
                except Exception as e:  # kept for the caller; the served version stays
                    self.last_error = e

        self._follower = threading.Thread(target=loop, name="recsdk-serving-follow", daemon=True)
        self._follower.start()

    def stop(self) -> None:
        """Stop following (waits for a refresh in progress)."""
        self._stop.set()
        if self._follower is not None:
            self._follower.join()
            self._follower = None

    def table_sizes(self) -> dict[str, int]:
        """Ids served per table."""
        return {name: n for c in self._collections.values() for name, n in c.table_sizes().items()}

    # ------------------------------------------------------------------ internals

    def _chain_start(self) -> int:
        plan = plan_chain(self.root)
        if not plan.apply:
            raise PublicationError("; ".join(plan.problems) + "; serving starts from a full version")
        return plan.apply[0]

    def _read(self, version: int) -> PublishedVersion:
        """Read and check a version (sizes, checksums, the model's tables and dense part)."""
        published = read_version(self.root, version)
        problems = differences(published.manifest, self._tables, self._dense_shapes)
        if problems:
            raise ValueError(f"version {version} under {self.root!r} is not this model's: " + "; ".join(problems))
        return published

    def _apply(self, published: PublishedVersion) -> None:
        # Everything a forward does not read is prepared while forwards run; they wait only for
        # the swap, a delta's row writes and the dense part.
        staged = [(c, c.stage_version(published)) for c in self._collections.values()]
        with self._lock.writing():
            for collection, version in staged:
                collection.commit_version(version)
            self.model.load_state_dict(published.dense, strict=False)
            self._version, self._step, self._kind = published.version, published.step, published.kind
            self._manifest = published.manifest


_switch = {"users": 0, "before": 0.0}
_switch_lock = threading.Lock()


@contextlib.contextmanager
def _short_switch_interval() -> Iterator[None]:
    """Python's thread switch interval at 0.2 ms while versions are read and applied (then as it
    was, once no refresh of any ServingModel runs): the refreshing thread and the forwarding
    threads both run Python, and at the default 5 ms a forward waits up to that long each time
    the refresh holds the GIL."""
    with _switch_lock:
        if _switch["users"] == 0:
            _switch["before"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch["before"], _REFRESH_SWITCH_INTERVAL_S))
        _switch["users"] += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch["users"] -= 1
            if _switch["users"] == 0:
                sys.setswitchinterval(_switch["before"])


def _configs(module: HashEmbeddingBagCollection | HashEmbeddingCollection) -> list[Any]:
    """The table configs of a hash collection (bag or not)."""
    if isinstance(module, HashEmbeddingBagCollection):
        return list(module.embedding_bag_configs())
    return list(module.embedding_configs())


def _replace(model: nn.Module, fqn: str, module: nn.Module) -> None:
    parent_name, _, name = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, name, module)
