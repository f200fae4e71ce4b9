"""Export hash-table embeddings as ``(id, embedding)`` pairs in Parquet, for serving and inspection.

Layout of an export directory::

    <path>/recsdk_embeddings.json                 # manifest, written last
    <path>/<table>/part-<rank>-of-<world>.parquet # one file per rank holding a shard of the table

Each file has two columns, ``id`` (int64, ascending) and ``embedding``
(``fixed_size_list<float32>[embedding_dim]``, or ``<float16>`` for a table stored in fp16: the
table's dtype is kept), and the table name and dim in its schema metadata. Every id of a table
appears in exactly one file. The directory is published atomically like a checkpoint (written
under ``.<name>.partial-<token>``, renamed at the end; removed if a write fails on any rank).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
from torch import nn

from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingCollection, IdTable
from recsdk.sharding.host_sharded_module import HostShardedModule
from recsdk.sharding.writing.atomic_directory import write_directory
from recsdk.sharding.writing.comm import Comm
from recsdk.sharding.writing.errors import os_reason
from recsdk.sharding.writing.hash_modules import root

__all__ = ["EXPORT_MANIFEST", "export_embeddings"]

EXPORT_MANIFEST = "recsdk_embeddings.json"
"""File name of an export's manifest; an export directory is complete exactly when it holds this file."""

_FORMAT = "recsdk.sharding.embeddings"
_VERSION = 1


def export_embeddings(model: nn.Module, path: str | os.PathLike[str]) -> dict[str, int]:
    """Write every hash table's ``(id, embedding)`` pairs to Parquet under the new directory ``path``.

    Collective when ``torch.distributed`` is initialised: every rank calls it with the same
    ``path`` and writes the ids of its own shards, in parallel. Works on a sharded model
    (``ShardedHashEmbeddingBagCollection`` and ``ShardedHashEmbeddingCollection`` modules)
    and on unsharded ``HashEmbeddingBagCollection`` and ``HashEmbeddingCollection`` modules
    (written by rank 0). Changes nothing in the model.

    Args:
        model (nn.Module): the ``DistributedModelParallel`` or any module holding hash tables.
        path (str | os.PathLike): directory to create; must not exist yet.

    Returns:
        dict[str, int]: number of ids exported per table (all ranks together).

    Raises:
        FileExistsError: ``path`` exists.
        FileNotFoundError: the parent directory of ``path`` does not exist.
        ValueError: the ranks passed different paths; two hash modules have a table of the same
            name, or the model has no hash table.
        OSError: writing failed on this rank (e.g. ``errno.ENOSPC``); its first line names the file.
        CheckpointError: writing failed on another rank (its error is in the message); nothing
            is published and the partial directory is removed.

    Example::

        export_embeddings(ddp_model, "export/step_1000")
        table = pyarrow.parquet.read_table("export/step_1000/user")  # columns id, embedding
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    sharded: dict[str, HostShardedModule] = {}
    unsharded: dict[str, dict[str, _Table]] = {}
    for fqn, module in root(model).named_modules():
        if isinstance(module, HostShardedModule):
            sharded[fqn] = module
        elif isinstance(module, HashEmbeddingBagCollection | HashEmbeddingCollection):
            unsharded[fqn] = _unsharded_tables(module)
    configs: list[tuple[str, str, int]] = [
        (fqn, name, int(cfg.embedding_dim)) for fqn, m in sharded.items() for name, cfg in m.table_configs.items()
    ]
    configs += [(fqn, name, t.dim) for fqn, tables in unsharded.items() for name, t in tables.items()]
    owners: dict[str, str] = {}
    dims: dict[str, int] = {}
    for fqn, name, dim in configs:
        if name in owners:
            raise ValueError(
                f"table {name!r} is in hash modules {owners[name]!r} and {fqn!r}; export needs distinct table names"
            )
        owners[name] = fqn
        dims[name] = dim
    if not owners:
        raise ValueError(
            "the model holds no hash table (HashEmbeddingBagCollection, HashEmbeddingCollection) to export"
        )
    pg = next(iter(sharded.values())).host_group if sharded else None
    final = os.path.abspath(os.fspath(path))
    comm = Comm(pg, what=f"exporting embeddings to {final!r}")

    def fill(tmp: str) -> dict[str, Any]:
        written = comm.run(_write_parts, sharded, unsharded, dims, tmp, comm.rank, comm.world)
        everyone = comm.gather(written)
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "world_size": comm.world,
            "tables": {
                name: {
                    "embedding_dim": dims[name],
                    "num_ids": sum(w.get(name, 0) for w in everyone),
                    "files": [
                        f"{name}/part-{r:05d}-of-{comm.world:05d}.parquet" for r, w in enumerate(everyone) if name in w
                    ],
                }
                for name in sorted(owners)
            },
        }

    manifest = write_directory(final, comm, "export", EXPORT_MANIFEST, fill, remove_stale=False)
    return {name: table["num_ids"] for name, table in manifest["tables"].items()}


class _Table(NamedTuple):
    """One table of an unsharded hash module."""

    dim: int
    weight: torch.Tensor
    id_table: IdTable


def _unsharded_tables(module: HashEmbeddingBagCollection | HashEmbeddingCollection) -> dict[str, _Table]:
    """Table name -> its dim, weight and id table, for an unsharded hash module."""
    tables = module.id_tables
    if isinstance(module, HashEmbeddingBagCollection):
        bags = module.embedding_bags
        return {
            c.name: _Table(int(c.embedding_dim), bags[c.name].weight, tables[c.name])
            for c in module.embedding_bag_configs()
        }
    embeddings = module.embeddings
    return {
        c.name: _Table(int(c.embedding_dim), embeddings[c.name].weight, tables[c.name])
        for c in module.embedding_configs()
    }


def _write_parts(
    sharded: dict[str, HostShardedModule],
    unsharded: dict[str, dict[str, _Table]],
    dims: dict[str, int],
    tmp: str,
    rank: int,
    world: int,
) -> dict[str, int]:
    """Write this rank's Parquet part of each table it holds (unsharded modules: rank 0); ids per table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pieces: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for module in sharded.values():
        views = module.table_views()
        for name, table in module.id_tables.items():
            ids, rows = table.ids_and_rows()
            weight = views[name].weight
            pieces.append((name, ids, weight.index_select(0, rows.to(weight.device))))
    if rank == 0:
        for tables in unsharded.values():
            for name, t in tables.items():
                if t.id_table.device.type == "meta":
                    continue
                ids, rows = t.id_table.ids_and_rows()
                weight = t.weight.detach()
                pieces.append((name, ids, weight.index_select(0, rows.to(weight.device))))
    written: dict[str, int] = {}
    for name, ids, emb in pieces:
        order = torch.argsort(ids)
        ids_np = ids[order].cpu().numpy()
        # The table's own dtype where Parquet has it (fp32, fp16); others (bf16) as fp32.
        dtype = emb.dtype if emb.dtype in (torch.float32, torch.float16) else torch.float32
        emb_np = emb[order].detach().to(device="cpu", dtype=dtype).contiguous().numpy()
        dim = dims[name]
        embedding = pa.FixedSizeListArray.from_arrays(pa.array(emb_np.reshape(-1)), dim)
        arrow = pa.table({"id": pa.array(ids_np, type=pa.int64()), "embedding": embedding})
        arrow = arrow.replace_schema_metadata({"recsdk.table": name, "recsdk.embedding_dim": str(dim)})
        folder = os.path.join(tmp, name)
        os.makedirs(folder, exist_ok=True)
        part = os.path.join(folder, f"part-{rank:05d}-of-{world:05d}.parquet")
        try:
            pq.write_table(arrow, part)
        except OSError as e:
            raise OSError(e.errno, f"{os_reason(e)} writing {part!r}; the export was not published") from e
        written[name] = int(ids_np.shape[0])
    return written
