"""recsdk-embedding: collision-free id tables with admission and eviction for raw int64 ids."""

from recsdk.embedding.id_table import IdTable, TableFullError
from recsdk.embedding.policies import CountAdmission, EvictionPolicy, LFUEviction, LRUEviction, TTLEviction

__all__ = [
    "CountAdmission",
    "EvictionPolicy",
    "IdTable",
    "LFUEviction",
    "LRUEviction",
    "TTLEviction",
    "TableFullError",
]
