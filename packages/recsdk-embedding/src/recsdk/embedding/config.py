"""Hash table configs: TorchRec's ``EmbeddingBagConfig`` / ``EmbeddingConfig`` plus admission and eviction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from torchrec.modules.embedding_configs import (
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)

from recsdk.embedding.policies import AdmissionPolicy, EvictionPolicy, check_policies
from recsdk.embedding.row_states import MAX_CAPACITY

__all__ = ["HashEmbeddingBagConfig", "HashEmbeddingConfig", "HashTableConfig"]

_POOLINGS = (PoolingType.SUM, PoolingType.MEAN)


def _check_table(cfg: BaseEmbeddingConfig, admission: AdmissionPolicy | None, eviction: EvictionPolicy | None) -> str:
    """The checks every hash table config makes; returns ``"<Config class> '<name>'"`` for further messages."""
    kind = type(cfg).__name__
    name = cfg.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind}: name must be a non-empty str, got {name!r}")
    where = f"{kind} '{name}'"
    for field, value in (("num_embeddings", cfg.num_embeddings), ("embedding_dim", cfg.embedding_dim)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where}: {field} must be an int, got {type(value).__name__} {value!r}")
        if value <= 0:
            raise ValueError(f"{where}: {field} must be > 0, got {value}")
    if cfg.num_embeddings > MAX_CAPACITY:
        raise ValueError(f"{where}: num_embeddings must be <= {MAX_CAPACITY}, got {cfg.num_embeddings}")
    if cfg.embedding_dim % 4:
        raise ValueError(
            f"{where}: embedding_dim must be a multiple of 4 (the fused CPU embedding kernel needs it), "
            f"got {cfg.embedding_dim}"
        )
    names = cfg.feature_names
    if not isinstance(names, list) or not names:
        raise ValueError(f"{where}: feature_names must be a non-empty list of str, got {names!r}")
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise ValueError(f"{where}: feature names must be non-empty str, got {bad}")
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"{where}: feature names must be distinct, repeated: {dups}")
    if not isinstance(cfg.data_type, DataType):
        raise TypeError(f"{where}: data_type must be a torchrec DataType (e.g. DataType.FP16), got {cfg.data_type!r}")
    if cfg.init_fn is not None and not callable(cfg.init_fn):
        raise TypeError(f"{where}: init_fn must be callable (weight -> weight) or None, got {cfg.init_fn!r}")
    low, high = cfg.weight_init_min, cfg.weight_init_max
    if low is not None and high is not None and low > high:
        raise ValueError(f"{where}: weight_init_min must be <= weight_init_max, got {low} > {high}")
    check_policies(where, admission, eviction)
    return where


@dataclass
class HashEmbeddingBagConfig(EmbeddingBagConfig):
    """An embedding-bag table keyed by raw int64 ids (a TorchRec ``EmbeddingBagConfig`` subclass).

    The planner and ``DistributedModelParallel`` take it wherever they take an
    ``EmbeddingBagConfig``. ``num_embeddings`` is the table's capacity in rows: how many distinct
    ids it can hold at once. Ids are any int64 values; the table's id table maps them to rows.

    Validated at construction: ``embedding_dim`` positive and a multiple of 4 (the fused CPU
    embedding kernel used by the sharded path needs it), ``num_embeddings`` positive, a non-empty
    ``name``, non-empty distinct ``feature_names``, pooling SUM or MEAN, a ``DataType``, a callable
    ``init_fn`` (or None), ``weight_init_min <= weight_init_max``, known policy types.

    Args:
        admission (CountAdmission | ScoreAdmission | ProbabilisticAdmission | None): admit ids
            after enough sightings, once their show/click score reaches a threshold, or with a
            probability per occurrence; None admits at once.
        eviction (LRUEviction | LFUEviction | TTLEviction | ScoreEviction | None): what frees rows
            when the table is full (score eviction: the lowest show/click scores, also every N
            steps if set); None makes a full table raise ``TableFullError``. A show/click score
            reads each id's clicks from the sparse features' weights
            (``recsdk.data.Batch.with_clicks()``), so it cannot be used in a weighted collection.
        (other fields): as ``torchrec.EmbeddingBagConfig``.

    Example::

        HashEmbeddingBagConfig(
            name="user", embedding_dim=64, num_embeddings=1 << 20, feature_names=["user_id"],
            admission=CountAdmission(threshold=2), eviction=LRUEviction(),
        )
    """

    admission: AdmissionPolicy | None = None
    eviction: EvictionPolicy | None = None

    def __post_init__(self) -> None:
        where = _check_table(self, self.admission, self.eviction)
        if self.pooling not in _POOLINGS:
            raise ValueError(f"{where}: pooling must be PoolingType.SUM or PoolingType.MEAN, got {self.pooling}")
        super().__post_init__()


@dataclass
class HashEmbeddingConfig(EmbeddingConfig):
    """A sequence (unpooled) embedding table keyed by raw int64 ids (a TorchRec ``EmbeddingConfig`` subclass).

    What :class:`HashEmbeddingBagConfig` is to ``EmbeddingBagConfig``, for
    :class:`~recsdk.embedding.HashEmbeddingCollection`: the planner and
    ``DistributedModelParallel`` take it wherever they take an ``EmbeddingConfig``;
    ``num_embeddings`` is the capacity in rows (distinct ids held at once); ids are any int64.

    Validated at construction as :class:`HashEmbeddingBagConfig` is (dim positive and a multiple
    of 4, capacity positive, non-empty name, non-empty distinct feature names, known policy types);
    there is no pooling to check.

    Args:
        admission (AdmissionPolicy | None): as in :class:`HashEmbeddingBagConfig` (None: at once).
        eviction (EvictionPolicy | None): as in :class:`HashEmbeddingBagConfig` (None: a full
            table raises ``TableFullError``).
        (other fields): as ``torchrec.EmbeddingConfig``.

    Example::

        HashEmbeddingConfig(
            name="item", embedding_dim=64, num_embeddings=1 << 20,
            feature_names=["item_history", "candidate_item"], eviction=LRUEviction(),
        )
    """

    admission: AdmissionPolicy | None = None
    eviction: EvictionPolicy | None = None

    def __post_init__(self) -> None:
        _check_table(self, self.admission, self.eviction)
        super().__post_init__()


HashTableConfig: TypeAlias = HashEmbeddingBagConfig | HashEmbeddingConfig
"""Either hash config: what :class:`~recsdk.embedding.hash_tables.HashIdTables` builds id tables from."""
