"""The per-batch contexts of the host-staged hash modules, and the batch token the parts key on.

They sit below the parts (host stage, row ledger) and the adapters, so that no part imports an
adapter: the arrows run adapter -> parts -> context -> TorchRec.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torchrec.distributed.embedding import EmbeddingCollectionContext
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Multistreamable

from recsdk.sharding._torchrec_compat import init_ec_context

__all__ = [
    "CachedRows",
    "HashEmbeddingBagCollectionContext",
    "HashEmbeddingCollectionContext",
    "HostStageState",
    "new_batch_token",
    "record_device_tensors",
]

_TOKENS = itertools.count()

CachedRows = dict[str, tuple[list[tuple[int, int]], torch.Tensor]]
"""Per cached table: the ``[start, end)`` ranges of its features' values in a KJT, and those values."""


def new_batch_token() -> int:
    """A process-unique token for one batch (the row ledger's key)."""
    return next(_TOKENS)


def record_device_tensors(obj: Any, stream: torch.Stream) -> None:
    """Mark every accelerator tensor that ``obj`` holds as used by ``stream`` (``record_stream``).

    TorchRec's pipelines call a context's ``record_stream`` when a batch moves to another
    stream, and TorchRec's contexts record every tensor they hold, assuming all are on the
    device. A host-staged module's contexts also hold host tensors (the received raw ids, the
    id all-to-all's permutations), which ``record_stream`` refuses; so its contexts record
    only their device tensors, found by walking the context: its attributes, lists, tuples,
    dicts, KJTs and nested contexts.

    Args:
        obj (Any): a context (or anything it holds).
        stream (torch.Stream): the stream that uses the tensors.
    """
    seen: set[int] = set()
    todo = [obj]
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if item.device.type != "cpu":
                item.record_stream(stream)
        elif isinstance(item, KeyedJaggedTensor):
            todo += [item.values(), item.lengths_or_none(), item.offsets_or_none(), item.weights_or_none()]
        elif isinstance(item, (list, tuple)):
            todo += list(item)
        elif isinstance(item, dict):
            todo += list(item.values())
        elif isinstance(item, (Multistreamable, HostStageState)):
            todo += list(vars(item).values())


@dataclass
class HostStageState:
    """What the host stage did for one batch.

    Attributes:
        token (int): this batch's key in the row ledger (which rows it holds, which it owes a
            reset).
        ids_mapped (bool): ``post_input_dist`` already turned raw ids into rows.
        batch_rows (dict[str, torch.Tensor]): per table, the rows this batch looks up.
        missing (list[torch.Tensor | None]): unpooled tables: per sharding type, the ids
            without a row (their embeddings are zeroed after the lookup).
        cache_rows (list[CachedRows]): per KJT (sharding type), per cached table, the
            ``[start, end)`` ranges of its features' values and the store rows they hold, as the
            host stage checked them.
        input_error (Exception | None): what was wrong with this rank's input. ``input_dist``
            sends an empty batch in its place (so peers are not left in the id all-to-all)
            and the host stage raises it through the failure agreement, on every rank.
        batch_failed (bool): some rank's input for this batch was bad (its flag arrived with the
            ids): no rank maps the batch's ids, so a failed step changes no id table.
    """

    token: int = field(default_factory=new_batch_token)
    ids_mapped: bool = False
    batch_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    missing: list[torch.Tensor | None] = field(default_factory=list)
    cache_rows: list[CachedRows] = field(default_factory=list)
    input_error: Exception | None = None
    batch_failed: bool = False


@dataclass
class HashEmbeddingBagCollectionContext(EmbeddingBagCollectionContext, HostStageState):
    """TorchRec's EBC context plus :class:`HostStageState`.

    Attributes:
        bag_lengths (dict[str, torch.Tensor]): per MEAN feature, its bags' lengths in this rank's
            batch as received (what :class:`~recsdk.sharding.distribution.mean_pooling.MeanPooling` divides by).
    """

    bag_lengths: dict[str, torch.Tensor] = field(default_factory=dict)

    def record_stream(self, stream: torch.Stream) -> None:
        record_device_tensors(self, stream)  # the received ids stay on the host


@dataclass
class HashEmbeddingCollectionContext(EmbeddingCollectionContext, HostStageState):
    """TorchRec's EC context plus :class:`HostStageState`.

    Attributes:
        padded (bool): this rank's batch was empty and went through TorchRec as one sample
            without ids (its sequence lookups cannot take a batch of size 0); the output drops it.
    """

    padded: bool = False

    def __post_init__(self) -> None:
        init_ec_context(self)  # TorchRec 1.6's base fields (its context is no dataclass); nothing on 1.8

    def record_stream(self, stream: torch.Stream) -> None:
        record_device_tensors(self, stream)  # the received ids stay on the host
