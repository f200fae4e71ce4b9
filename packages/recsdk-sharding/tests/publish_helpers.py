"""What the publishing tests share: the model's true state (an export) and the comparison with a replay."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from recsdk.embedding import replay
from recsdk.sharding import export_embeddings, sharded_hash_modules


def true_state(model, directory: str, exclude_owed: bool = True) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per table, every id the model holds with its row, ascending by id (from an export: another
    read path than the publisher's), minus the ids whose rows are owed a reset (a pipeline mapped
    them ahead; they are published once their batch computes). Collective."""
    export_embeddings(model, directory)
    owed: list[int] = []
    if exclude_owed:
        for module in sharded_hash_modules(model).values():
            for name, rows in module.ledger.owed_resets().items():
                ids, occupied = module.id_tables[name].occupants(rows)
                owed += ids[occupied].tolist()
    everyone: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, owed)
    skip = torch.tensor(sorted({i for part in everyone for i in part}), dtype=torch.int64)
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not os.path.isdir(path):
            continue
        table = pq.read_table(path)
        ids = torch.from_numpy(table.column("id").to_numpy())
        emb = table.column("embedding").combine_chunks()
        rows = torch.from_numpy(emb.values.to_numpy(zero_copy_only=False).reshape(len(ids), -1)).float()
        keep = ~torch.isin(ids, skip)
        order = torch.argsort(ids[keep])
        out[name] = (ids[keep][order], rows[keep][order])
    return out


def compare(root: str, version: int, truth: dict[str, tuple[torch.Tensor, torch.Tensor]], atol: float = 0) -> list[str]:
    """How the replay of ``version`` differs from ``truth`` (``[]``: equal; ``atol`` 0: bit for bit)."""
    state = replay(root, version)
    problems = []
    for name, (ids, rows) in truth.items():
        got = state.tables[name]
        if not torch.equal(got.ids, ids):
            extra = set(got.ids.tolist()) - set(ids.tolist())
            missing = set(ids.tolist()) - set(got.ids.tolist())
            problems.append(f"v{version} {name}: {len(extra)} ids too many, {len(missing)} missing")
            continue
        emb = got.embeddings()
        if atol == 0.0 and not torch.equal(emb, rows):
            problems.append(f"v{version} {name}: rows differ, max {float((emb - rows).abs().max())}")
        elif atol and not torch.allclose(emb, rows, rtol=0, atol=atol):
            problems.append(f"v{version} {name}: rows differ beyond {atol}: max {float((emb - rows).abs().max())}")
    return problems
