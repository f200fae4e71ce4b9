"""recsdk-sharding: hybrid sharders, id ownership and planner glue.

The host does the id work (bucketing by :func:`owner`, the id all-to-alls over a gloo group,
id-to-row mapping in each shard's id table); the device does the lookups with TorchRec's
fused kernels and the pooled output dist over the default group.
"""

from recsdk.embedding import read_version
from recsdk.sharding.checkpoint import (
    CHECKPOINT_MANIFEST,
    AsyncCheckpointer,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from recsdk.sharding.context import HashEmbeddingBagCollectionContext, HashEmbeddingCollectionContext
from recsdk.sharding.distribution.agreement import CarriedFlag, FailureAgreement, PeerFailureError
from recsdk.sharding.distribution.input_dist import (
    HostTwSparseFeaturesDist,
    OwnerSequenceFeaturesDist,
    OwnerSparseFeaturesDist,
    bucketize_by_owner,
)
from recsdk.sharding.distribution.input_guard import refuse_inputs
from recsdk.sharding.distribution.kjt_all_to_all import FusedKJTAllToAll
from recsdk.sharding.distribution.output_dist import (
    AllToAllPooledEmbeddingDist,
    FlagCarrier,
    FlagCarryingTwPooledEmbeddingDist,
)
from recsdk.sharding.distribution.owner import OWNER_SALT, owner
from recsdk.sharding.distribution.shardings import (
    GlooRwPooledEmbeddingSharding,
    HostRwPooledEmbeddingSharding,
    HostRwSequenceEmbeddingSharding,
    HostTwPooledEmbeddingSharding,
    HostTwSequenceEmbeddingSharding,
)
from recsdk.sharding.host.row_ledger import RowLedger
from recsdk.sharding.host_sharded_module import HostShardedModule, sharded_hash_modules
from recsdk.sharding.planning.cache_plan import CACHED_KERNELS, DEFAULT_LOAD_FACTOR, TableCacheSpec, cache_specs
from recsdk.sharding.planning.cost_model import HybridPerfEstimator, HybridPerfModel
from recsdk.sharding.planning.hybrid_costs import DEFAULT_COSTS, HybridCosts, ShardCost
from recsdk.sharding.planning.planner import HybridEmbeddingEnumerator, IdTableStorageEstimator, id_table_bytes
from recsdk.sharding.planning.sharding_planner import HybridEmbeddingShardingPlanner
from recsdk.sharding.publishing.export import EXPORT_MANIFEST, export_embeddings
from recsdk.sharding.publishing.publisher import Publisher, PublishRecord
from recsdk.sharding.rows.row_cache import TableCache
from recsdk.sharding.rows.row_store import FileRowStore, HostRowStore, RowStore
from recsdk.sharding.rows.tbe_views import TableViews
from recsdk.sharding.sharded_hash_embedding_bag import ShardedHashEmbeddingBagCollection
from recsdk.sharding.sharded_hash_embedding_collection import ShardedHashEmbeddingCollection
from recsdk.sharding.sharders import (
    HashEmbeddingBagCollectionSharder,
    HashEmbeddingCollectionSharder,
    HybridEmbeddingBagCollectionSharder,
    HybridShardedEmbeddingBagCollection,
    get_default_hybrid_sharders,
    validate_host_env,
)

__all__ = [
    "CACHED_KERNELS",
    "CHECKPOINT_MANIFEST",
    "DEFAULT_COSTS",
    "DEFAULT_LOAD_FACTOR",
    "EXPORT_MANIFEST",
    "OWNER_SALT",
    "AllToAllPooledEmbeddingDist",
    "AsyncCheckpointer",
    "CarriedFlag",
    "CheckpointError",
    "FailureAgreement",
    "FileRowStore",
    "FlagCarrier",
    "FlagCarryingTwPooledEmbeddingDist",
    "FusedKJTAllToAll",
    "GlooRwPooledEmbeddingSharding",
    "HashEmbeddingBagCollectionContext",
    "HashEmbeddingBagCollectionSharder",
    "HashEmbeddingCollectionContext",
    "HashEmbeddingCollectionSharder",
    "HostRowStore",
    "HostRwPooledEmbeddingSharding",
    "HostRwSequenceEmbeddingSharding",
    "HostShardedModule",
    "HostTwPooledEmbeddingSharding",
    "HostTwSequenceEmbeddingSharding",
    "HostTwSparseFeaturesDist",
    "HybridCosts",
    "HybridEmbeddingBagCollectionSharder",
    "HybridEmbeddingEnumerator",
    "HybridEmbeddingShardingPlanner",
    "HybridPerfEstimator",
    "HybridPerfModel",
    "HybridShardedEmbeddingBagCollection",
    "IdTableStorageEstimator",
    "OwnerSequenceFeaturesDist",
    "OwnerSparseFeaturesDist",
    "PeerFailureError",
    "PublishRecord",
    "Publisher",
    "RowLedger",
    "RowStore",
    "ShardCost",
    "ShardedHashEmbeddingBagCollection",
    "ShardedHashEmbeddingCollection",
    "TableCache",
    "TableCacheSpec",
    "TableViews",
    "bucketize_by_owner",
    "cache_specs",
    "export_embeddings",
    "get_default_hybrid_sharders",
    "id_table_bytes",
    "latest_checkpoint",
    "load_checkpoint",
    "owner",
    "read_version",
    "refuse_inputs",
    "save_checkpoint",
    "sharded_hash_modules",
    "validate_host_env",
]
