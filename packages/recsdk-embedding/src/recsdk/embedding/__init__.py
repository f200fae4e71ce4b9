"""recsdk-embedding: collision-free id tables and ``HashEmbeddingBagCollection`` for raw int64 ids."""

from recsdk.embedding.config import HashEmbeddingBagConfig
from recsdk.embedding.hash_embedding_bag import HashEmbeddingBagCollection, OptimizerAttachment
from recsdk.embedding.hashing import fmix64
from recsdk.embedding.id_table import IdTable, TableFullError
from recsdk.embedding.input_checks import check_features
from recsdk.embedding.policies import CountAdmission, EvictionPolicy, LFUEviction, LRUEviction, TTLEviction
from recsdk.embedding.row_init import init_rows_, reset_optimizer_rows_

__all__ = [
    "CountAdmission",
    "EvictionPolicy",
    "HashEmbeddingBagCollection",
    "HashEmbeddingBagConfig",
    "IdTable",
    "LFUEviction",
    "LRUEviction",
    "OptimizerAttachment",
    "TTLEviction",
    "TableFullError",
    "check_features",
    "fmix64",
    "init_rows_",
    "reset_optimizer_rows_",
]
