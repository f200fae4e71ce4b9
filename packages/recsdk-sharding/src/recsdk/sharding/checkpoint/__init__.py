"""Checkpoints of hybrid-sharded models: atomic, verified, collective, and loadable on another world size.

A checkpoint is a directory written with ``torch.distributed.checkpoint`` (DCP): one data file per
rank, DCP's ``.metadata``, and ``recsdk_checkpoint.json``, the manifest, written last. It holds

* per table shard of a sharded hash module (:class:`~recsdk.sharding.ShardedHashEmbeddingBagCollection`,
  :class:`~recsdk.sharding.ShardedHashEmbeddingCollection`): the fused
  kernel's weight rows and optimizer state rows, and the shard's whole
  :class:`~recsdk.embedding.IdTable` state (ids and their rows, per-id eviction metadata
  ``last_step`` and ``freq``, the free-row stack, admission counters, step clock and
  statistics), plus the shard's fused optimizer counters that are not per row (an Adam step
  count). Together these give every stored id its embedding, optimizer state and metadata, so
  a table can be rebuilt **by id** on any world size;
* the rest of the model's ``state_dict()`` (dense parameters and buffers, TorchRec-sharded
  tensors of other modules, which DCP reshards itself);
* the optimizer's state for everything but the hash tables and the hyperparameters of every
  parameter group (learning rates set by a scheduler included);
* each rank's ``extra`` object.

The manifest also records every file's size and CRC-32. Saving writes into
``.<name>.partial-<token>`` beside ``path`` and publishes it with one ``rename`` once every rank
has finished; loading checks the files, reads into staging buffers and changes the model only
once every rank has read and validated its part. A failure on one rank raises on every rank.

Modules: :mod:`.save`, :mod:`.async_save` (the same write on a background thread, from a
snapshot taken on the training thread), :mod:`.load` (with :mod:`.validate`, checking a checkpoint against the
model, and :mod:`.reshard`, rebuilding tables by id), :mod:`.manifest` (the format),
:mod:`.layout` (how the tables are laid out, and the per-table state beside the rows),
:mod:`.optimizer_state` and :mod:`.storage` (DCP). What checkpoints share with exports and
publications (collectives and the failure agreement, atomic directories, file sizes and
checksums, the hash modules read off the model) is :mod:`recsdk.sharding.writing`.
"""

from recsdk.sharding.checkpoint.async_save import AsyncCheckpointer
from recsdk.sharding.checkpoint.load import load_checkpoint
from recsdk.sharding.checkpoint.manifest import CHECKPOINT_MANIFEST, latest_checkpoint
from recsdk.sharding.checkpoint.save import save_checkpoint
from recsdk.sharding.writing.errors import CheckpointError

__all__ = [
    "CHECKPOINT_MANIFEST",
    "AsyncCheckpointer",
    "CheckpointError",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
