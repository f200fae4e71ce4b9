"""recsdk-embedding: collision-free id tables and TorchRec embedding modules on raw int64 ids.

``HashEmbeddingBagCollection`` (pooled, an ``EmbeddingBagCollection``) and ``HashEmbeddingCollection``
(sequence, an ``EmbeddingCollection``).
"""

from recsdk.embedding.change_tracker import ChangeSnapshot, RowChangeTracker
from recsdk.embedding.config import HashEmbeddingBagConfig, HashEmbeddingConfig
from recsdk.embedding.hash_embedding import HashEmbeddingCollection
from recsdk.embedding.hash_embedding_bag import HashEmbeddingBagCollection
from recsdk.embedding.hash_tables import OptimizerAttachment
from recsdk.embedding.hashing import fmix64
from recsdk.embedding.id_table import IdTable, TableFullError
from recsdk.embedding.id_table_publishing import IdTablePublishing
from recsdk.embedding.id_table_state import IdTableState
from recsdk.embedding.input_checks import check_features
from recsdk.embedding.policies import (
    AdmissionPolicy,
    CountAdmission,
    EvictionPolicy,
    LFUEviction,
    LRUEviction,
    ProbabilisticAdmission,
    ScoreAdmission,
    ScoreEviction,
    ShowClickScore,
    TTLEviction,
)
from recsdk.embedding.publication import PublicationError, latest_version, list_versions
from recsdk.embedding.publication_reader import PublishedTable, PublishedVersion, read_version, replay
from recsdk.embedding.row_init import init_rows_, reset_optimizer_rows_

__all__ = [
    "AdmissionPolicy",
    "ChangeSnapshot",
    "CountAdmission",
    "EvictionPolicy",
    "HashEmbeddingBagCollection",
    "HashEmbeddingBagConfig",
    "HashEmbeddingCollection",
    "HashEmbeddingConfig",
    "IdTable",
    "IdTablePublishing",
    "IdTableState",
    "LFUEviction",
    "LRUEviction",
    "OptimizerAttachment",
    "ProbabilisticAdmission",
    "PublicationError",
    "PublishedTable",
    "PublishedVersion",
    "RowChangeTracker",
    "ScoreAdmission",
    "ScoreEviction",
    "ShowClickScore",
    "TTLEviction",
    "TableFullError",
    "check_features",
    "fmix64",
    "init_rows_",
    "latest_version",
    "list_versions",
    "read_version",
    "replay",
    "reset_optimizer_rows_",
]
