"""Checking a checkpoint against the model before anything is read: the lists of problems.

:func:`plan_load` compares the manifest and DCP's metadata with the model and the optimizer and
lists every difference this rank can see (hash modules and tables, embedding dims, weight and
optimizer state layouts, admission counters, pinned rows, dense keys and shapes, optimizer
parameters), together with the plan for each table: read back row for row (same layout) or
rebuilt by id.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torchrec.optim.keyed import KeyedOptimizer

from recsdk.sharding import _torchrec_compat as compat
from recsdk.sharding.checkpoint.layout import TableLayout, admission_counters, fused_counters, layouts, score_layout
from recsdk.sharding.checkpoint.manifest import optim_key
from recsdk.sharding.checkpoint.optimizer_state import hash_param_ids
from recsdk.sharding.writing.hash_modules import HashModule, hash_weight_keys

__all__ = ["TableLoad", "plan_load"]


@dataclass
class TableLoad:
    """One table of the model and its entry in the checkpoint; ``exact``: same layout, read row for row.

    For a table rebuilt by id, :func:`~recsdk.sharding.checkpoint.reshard.read_resharded` fills
    in the records this rank receives, sorted by id.
    """

    fqn: str
    name: str
    module: HashModule
    layout: TableLayout
    saved: dict[str, Any]
    exact: bool
    ids: torch.Tensor | None = None
    meta: torch.Tensor | None = None  # int64 [n, 2]: last_step, freq
    weight_rows: torch.Tensor | None = None
    state_rows: list[torch.Tensor] = field(default_factory=list)
    counters: torch.Tensor | None = None
    scores: torch.Tensor | None = None  # int64 [n] stored show/click scores (score eviction), at score_ref
    score_counters: torch.Tensor | None = None  # the score admission sketch, at score_ref
    score_ref: int = 0
    step: int = 0
    fused: dict[str, torch.Tensor] = field(default_factory=dict)  # optimizer counters: max over saved shards


def plan_load(
    model: nn.Module,
    optimizer: KeyedOptimizer | None,
    modules: Mapping[str, HashModule],
    manifest: dict[str, Any],
    reader_md: Mapping[str, Any],
    rank: int,
    world: int,
) -> tuple[list[str], list[TableLoad]]:
    """Compare the checkpoint with the model; list every difference this rank can see.

    Returns:
        tuple[list[str], list[TableLoad]]: the problems (empty: the checkpoint fits) and a
        plan per table of the model.
    """
    problems: list[str] = []
    loads: list[TableLoad] = []
    saved_modules: dict[str, Any] = manifest["hash_modules"]
    for fqn in sorted(set(saved_modules) - set(modules)):
        problems.append(f"hash module {fqn!r} is in the checkpoint but not in the model")
    for fqn in sorted(set(modules) - set(saved_modules)):
        problems.append(f"hash module {fqn!r} is in the model but not in the checkpoint")
    same_world = int(manifest["world_size"]) == world
    for fqn in sorted(set(modules) & set(saved_modules)):
        module, saved_tables = modules[fqn], saved_modules[fqn]
        table_layouts = layouts(module)
        where = f"hash module {fqn!r}"
        for name in sorted(set(saved_tables) - set(table_layouts)):
            problems.append(f"{where}: table {name!r} is in the checkpoint but not in the model")
        for name in sorted(set(table_layouts) - set(saved_tables)):
            problems.append(f"{where}: table {name!r} is in the model but not in the checkpoint")
        for name in sorted(set(table_layouts) & set(saved_tables)):
            layout, saved = table_layouts[name], saved_tables[name]
            table_where = f"{where}, table {name!r}"
            if saved["embedding_dim"] != layout.embedding_dim:
                problems.append(
                    f"{table_where}: embedding_dim {saved['embedding_dim']} in the checkpoint, "
                    f"{layout.embedding_dim} in the model"
                )
                continue
            counters = admission_counters(module, name)
            if saved["admission_counters"] != counters:
                problems.append(
                    f"{table_where}: {saved['admission_counters']} admission counters in the checkpoint, "
                    f"{counters} in the model (CountAdmission counter_slots/num_hashes/threshold differ)"
                )
            per_row, score_counters = score_layout(module, name)
            saved_scores = (bool(saved.get("scores_per_row", False)), int(saved.get("score_counters", 0)))
            if saved_scores != (per_row, score_counters):
                problems.append(
                    f"{table_where}: show/click scores per row {saved_scores[0]} and {saved_scores[1]} score counters "
                    f"in the checkpoint, {per_row} and {score_counters} in the model (ScoreEviction / ScoreAdmission "
                    "counter_slots/num_hashes differ)"
                )
            if name in module.id_tables:
                problems.extend(_local_table_problems(module, name, saved, table_where, rank))
            saved_shards = [(s["rank"], s["row_offset"], s["rows"]) for s in saved["shards"]]
            exact = (
                same_world
                and saved["num_embeddings"] == layout.num_embeddings
                and saved["sharding_type"] == layout.sharding_type
                and saved_shards == layout.shards
            )
            if layout.sharding_type == "row_wise" and [r for r, _, _ in layout.shards] != list(range(world)):
                problems.append(f"{table_where}: row-wise shards must be on ranks 0..{world - 1} in order")
            loads.append(TableLoad(fqn, name, module, layout, saved, exact))
    problems.extend(_dense_problems(model, modules, reader_md))
    if optimizer is not None:
        problems.extend(_optimizer_problems(optimizer, modules, manifest, reader_md))
    return problems, loads


def _local_table_problems(module: HashModule, name: str, saved: dict[str, Any], where: str, rank: int) -> list[str]:
    problems = []
    weight, states = module.table_views()[name]
    if saved["weight_dtype"] != str(weight.dtype):
        problems.append(f"{where}: weights are {saved['weight_dtype']} in the checkpoint, {weight.dtype} in the model")
    mine = [{"shape": list(s.shape[1:]), "dtype": str(s.dtype)} for s in states]
    if saved["optimizer_states"] != mine:
        problems.append(
            f"{where}: fused optimizer state per row {_describe_states(saved['optimizer_states'])} "
            f"in the checkpoint, {_describe_states(mine)} in the model (another sparse optimizer?)"
        )
    mine_counters = sorted(fused_counters(module)[name])
    if saved.get("optimizer_counters", []) != mine_counters:
        problems.append(
            f"{where}: fused optimizer counters {saved.get('optimizer_counters', [])} in the "
            f"checkpoint, {mine_counters} in the model (another sparse optimizer?)"
        )
    pinned = module.id_tables[name].num_pinned()
    if pinned:
        problems.append(
            f"{where}: {pinned} rows on rank {rank} are pinned by batches in flight; finish the pipeline's "
            "batches before loading"
        )
    return problems


def _describe_states(states: list[dict[str, Any]]) -> str:
    if not states:
        return "none (SGD)"
    return ", ".join(f"{s['dtype']}{s['shape']}" for s in states)


def _dense_problems(model: nn.Module, modules: Mapping[str, HashModule], reader_md: Mapping[str, Any]) -> list[str]:
    hash_keys = hash_weight_keys(modules)
    problems = []
    mine = {k: v for k, v in model.state_dict().items() if k not in hash_keys}
    saved = {k[len("model/") :]: v for k, v in reader_md.items() if k.startswith("model/")}
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    if missing:
        problems.append(f"model keys missing from the checkpoint: {missing}")
    if unexpected:
        problems.append(f"checkpoint keys the model does not have: {unexpected}")
    for key in sorted(set(mine) & set(saved)):
        value, md = mine[key], saved[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                problems.append(f"model key {key!r}: a tensor in the model, not in the checkpoint")
            elif tuple(md.size) != tuple(value.size()):
                problems.append(
                    f"model key {key!r}: shape {list(md.size)} in the checkpoint, {list(value.size())} in the model"
                )
    return problems


def _optimizer_problems(
    optimizer: KeyedOptimizer,
    modules: Mapping[str, HashModule],
    manifest: dict[str, Any],
    reader_md: Mapping[str, Any],
) -> list[str]:
    saved: dict[str, dict[str, str]] | None = manifest.get("optimizer_state")
    if saved is None:
        return ["the checkpoint holds no optimizer state (saved with optimizer=None); pass optimizer=None"]
    problems = []
    hash_ids = hash_param_ids(modules)
    keys = {k for k, p in optimizer.params.items() if id(p) not in hash_ids}
    current = optimizer.state_dict()["state"]
    missing = sorted(keys - set(saved))
    if missing:
        problems.append(f"optimizer parameters missing from the checkpoint: {missing}")
    for pkey in sorted(keys & set(saved)):
        for skey, kind in saved[pkey].items():
            value = current.get(pkey, {}).get(skey)
            md = reader_md.get(optim_key(pkey, skey))
            if kind == "sharded" and not compat.is_sharded_tensor(value):
                problems.append(f"optimizer state {pkey!r}/{skey!r}: sharded in the checkpoint, not in the optimizer")
            elif (
                kind == "tensor"
                and isinstance(value, torch.Tensor)
                and isinstance(md, TensorStorageMetadata)
                and tuple(md.size) != tuple(value.shape)
            ):
                problems.append(
                    f"optimizer state {pkey!r}/{skey!r}: shape {list(md.size)} in the checkpoint, "
                    f"{list(value.shape)} in the optimizer"
                )
    return problems
