"""Resharding by id: rebuilding hash tables saved on another world size or sharding plan.

The saved shards are read in parallel (shard ``i`` of all tables by rank ``i % world_size``),
each stored id is routed to its new shard (``owner(id, world_size)`` row-wise, the table's rank
table-wise) with its embedding, optimizer state rows, ``last_step`` (shifted so that its age is
kept against the newest saved step clock), ``freq`` and show/click score (brought from its
shard's reference step to the newest shard's, ``round(score * decay**steps)``: a no-op when the
shards agree, as they do when every rank mapped every batch); admission sketches (count and
score, the latter rebased the same way) and per-shard optimizer counters are merged by
element-wise max. Nothing in the model changes until
:func:`commit_resharded`, which rebuilds each shard with :meth:`~recsdk.embedding.IdTableState.rebuild`
(rows ``0..n-1`` in id order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from recsdk.embedding.id_table_scores import rebased
from recsdk.embedding.policies import score_of
from recsdk.sharding.checkpoint import storage
from recsdk.sharding.checkpoint.layout import fused_counters
from recsdk.sharding.checkpoint.manifest import hash_prefix
from recsdk.sharding.checkpoint.validate import TableLoad
from recsdk.sharding.distribution.owner import owner
from recsdk.sharding.writing.comm import Comm

__all__ = ["check_resharded", "commit_resharded", "read_resharded"]

_INT32_MAX = 2**31 - 1

Job = tuple[TableLoad, dict[str, Any]]


def read_resharded(
    tables: list[TableLoad],
    reader_md: Mapping[str, Any],
    comm: Comm,
    read: Callable[[dict[str, Any]], None],
) -> None:
    """Collective: read the saved shards of ``tables``, route every id to its new shard, check capacity.

    ``read`` is the collective read into staging buffers (its failures agreed). Fills
    ``ids``/``meta``/``weight_rows``/``state_rows``/``counters``/``step``/``fused`` of the tables
    this rank holds in the new layout. Modifies nothing in the model.

    Raises:
        CheckpointError: reading failed (on every rank).
        ValueError: the ids of a new shard exceed its capacity (on every rank, naming table,
            rank, ids and capacity).
    """
    mine, targets = comm.run(_targets, tables, reader_md, comm.rank, comm.world)
    read(targets)
    outgoing, counts, fused_local = comm.run(_route, tables, mine, targets, comm.world)
    gathered = comm.gather((counts, fused_local))
    all_counts = torch.stack([c for c, _ in gathered])  # [source, table, dest]
    for _, theirs in gathered:
        for ti, values in theirs.items():
            merged = tables[ti].fused
            for k, v in values.items():
                merged[k] = v.clone() if k not in merged else torch.maximum(merged[k], v)
    comm.run(_check_capacity, tables, all_counts.sum(0), comm.world)

    for ti, t in enumerate(tables):
        out = outgoing[ti]
        send = counts[ti].tolist()
        recv = all_counts[:, ti, comm.rank].tolist()
        ids = comm.all_to_all(out["ids"], send, recv)
        meta = comm.all_to_all(out["meta"], send, recv)
        weight = comm.all_to_all(out["weight"], send, recv)
        states = [comm.all_to_all(s, send, recv) for s in out["states"]]
        scores = comm.all_to_all(out["scores"], send, recv) if out["scores"] is not None else None
        sketch, score_sketch = out["sketch"], out["score_sketch"]
        if sketch is not None:
            comm.max_(sketch)
        if score_sketch is not None:
            comm.max_(score_sketch)
        if t.name in t.module.id_tables:
            if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
                order = torch.argsort(ids)
                ids, meta, weight = ids[order], meta[order], weight[order]
                states = [s[order] for s in states]
                scores = scores[order] if scores is not None else None
            t.ids, t.meta, t.weight_rows, t.state_rows = ids, meta, weight, states
            t.counters, t.scores, t.score_counters = sketch, scores, score_sketch


def _targets(
    tables: list[TableLoad], reader_md: Mapping[str, Any], rank: int, world: int
) -> tuple[list[Job], dict[str, torch.Tensor]]:
    jobs = [(t, shard) for t in tables for shard in t.saved["shards"]]
    mine = [job for i, job in enumerate(jobs) if i % world == rank]
    targets: dict[str, torch.Tensor] = {}
    for t, shard in mine:
        prefix = hash_prefix(t.fqn, t.name, shard["rank"])
        keys = ["table/ids", "table/rows", "table/last_step", "table/freq", "table/admission_counters", "weight"]
        keys += [k for k in ("table/scores", "table/score_counters") if prefix + k in reader_md]
        keys += [f"state{i}" for i in range(len(t.saved["optimizer_states"]))]
        keys += [f"fused/{k}" for k in t.saved.get("optimizer_counters", [])]
        for k in keys:
            targets[prefix + k] = storage.empty_like_saved(reader_md[prefix + k])
    return mine, targets


def _route(
    tables: list[TableLoad], mine: list[Job], targets: dict[str, torch.Tensor], world: int
) -> tuple[list[dict[str, Any]], torch.Tensor, dict[int, dict[str, torch.Tensor]]]:
    """This rank's saved records per table, ordered by destination rank then id, and their counts."""
    outgoing: list[dict[str, Any]] = []
    counts = torch.zeros(len(tables), world, dtype=torch.int64)
    for ti, t in enumerate(tables):
        new_step = max((int(s["step"]) for s in t.saved["shards"]), default=0)
        t.step = new_step
        t.score_ref = max((int(s.get("score_ref", 0)) for s in t.saved["shards"]), default=0)
        cfg = t.module.table_configs.get(t.name)
        score = score_of(getattr(cfg, "admission", None), getattr(cfg, "eviction", None))
        decay = score.decay if score is not None else 1.0
        parts: dict[str, list[torch.Tensor]] = {"ids": [], "meta": [], "weight": [], "counters": []}
        parts |= {"scores": [], "score_counters": []}
        state_parts: list[list[torch.Tensor]] = [[] for _ in t.saved["optimizer_states"]]
        for job_table, shard in mine:
            if job_table is not t:
                continue
            prefix = hash_prefix(t.fqn, t.name, shard["rank"])
            rows = targets[prefix + "table/rows"]
            shift = new_step - int(shard["step"])
            last = (targets[prefix + "table/last_step"].to(torch.int64) + shift).clamp_(0, _INT32_MAX)
            parts["ids"].append(targets[prefix + "table/ids"])
            parts["meta"].append(torch.stack([last, targets[prefix + "table/freq"].to(torch.int64)], dim=1))
            parts["weight"].append(targets[prefix + "weight"].index_select(0, rows))
            parts["counters"].append(targets[prefix + "table/admission_counters"])
            behind = t.score_ref - int(shard.get("score_ref", 0))  # reference steps this shard is behind
            for key in ("scores", "score_counters"):
                if prefix + "table/" + key in targets and targets[prefix + "table/" + key].numel():
                    parts[key].append(rebased(targets[prefix + "table/" + key], decay, behind))
            for i in range(len(state_parts)):
                state_parts[i].append(targets[prefix + f"state{i}"].index_select(0, rows))
        dim = t.layout.embedding_dim
        ids = torch.cat(parts["ids"]) if parts["ids"] else torch.zeros(0, dtype=torch.int64)
        meta = torch.cat(parts["meta"]) if parts["meta"] else torch.zeros(0, 2, dtype=torch.int64)
        weight_dtype = _dtype(t.saved["weight_dtype"])
        weight = torch.cat(parts["weight"]) if parts["weight"] else torch.zeros(0, dim, dtype=weight_dtype)
        states = [
            torch.cat(p) if p else torch.zeros(0, *s["shape"], dtype=_dtype(s["dtype"]))
            for p, s in zip(state_parts, t.saved["optimizer_states"], strict=True)
        ]
        if t.layout.sharding_type == "row_wise":
            dest = owner(ids, world)
        else:
            dest = torch.full_like(ids, t.layout.shards[0][0])
        # By destination, then by id: a rank receiving from one source needs no re-sorting.
        by_id = torch.argsort(ids)
        order = by_id.index_select(0, torch.argsort(dest.index_select(0, by_id), stable=True))
        counts[ti] = torch.bincount(dest, minlength=world)
        sketch = _merged(parts["counters"], int(t.saved["admission_counters"]), torch.int32)
        score_sketch = _merged(parts["score_counters"], int(t.saved.get("score_counters", 0)), torch.int64)
        scores = None
        if t.saved.get("scores_per_row", False):
            scores = torch.cat(parts["scores"]) if parts["scores"] else torch.zeros(0, dtype=torch.int64)
        outgoing.append(
            {
                "ids": ids[order],
                "meta": meta[order],
                "weight": weight[order],
                "states": [s[order] for s in states],
                "scores": scores[order] if scores is not None else None,
                "sketch": sketch,
                "score_sketch": score_sketch,
            }
        )
    fused_local: dict[int, dict[str, torch.Tensor]] = {}
    for ti, t in enumerate(tables):
        for job_table, shard in mine:
            if job_table is t:
                prefix = hash_prefix(t.fqn, t.name, shard["rank"])
                for k in t.saved.get("optimizer_counters", []):
                    mine_max = fused_local.setdefault(ti, {})
                    value = targets[prefix + f"fused/{k}"]
                    mine_max[k] = value if k not in mine_max else torch.maximum(mine_max[k], value)
    return outgoing, counts, fused_local


def _merged(parts: list[torch.Tensor], size: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The element-wise max of a sketch's saved copies (None when the table has none)."""
    if not size:
        return None
    merged = torch.zeros(size, dtype=dtype)
    for part in parts:
        merged = torch.maximum(merged, part.to(dtype))
    return merged


def _check_capacity(tables: list[TableLoad], totals: torch.Tensor, world: int) -> None:
    problems = []
    for ti, t in enumerate(tables):
        for r in range(world):
            need, cap = int(totals[ti, r]), t.layout.rows_on(r)
            if need > cap:
                problems.append(
                    f"hash module {t.fqn!r}, table {t.name!r}: rank {r} would hold {need} ids but its shard has "
                    f"capacity {cap} ({t.layout.sharding_type}, num_embeddings {t.layout.num_embeddings}, "
                    f"world size {world}); raise num_embeddings or load on more ranks"
                )
    if problems:
        raise ValueError(
            "the checkpoint's ids do not fit the model's shards (nothing was loaded):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


def _dtype(name: str | None) -> torch.dtype:
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the checkpoint manifest")
    return value


def check_resharded(t: TableLoad) -> None:
    """Raise unless the records routed to this rank rebuild its shard of ``t`` (changes nothing).

    Raises:
        ValueError: repeated ids (a damaged checkpoint), or rows of another shape than the shard's.
    """
    assert t.ids is not None and t.meta is not None and t.weight_rows is not None
    where = f"hash module {t.fqn!r}, table {t.name!r}"
    n = t.ids.numel()
    if n > 1 and not bool((t.ids[1:] > t.ids[:-1]).all()):
        raise ValueError(f"{where}: the checkpoint holds some ids twice (a damaged checkpoint?)")
    if n and bool(((t.meta < 0) | (t.meta > _INT32_MAX)).any()):
        raise ValueError(f"{where}: last_step or freq out of [0, {_INT32_MAX}] (a damaged checkpoint?)")
    weight, states = t.module.table_views()[t.name]
    if n > weight.shape[0] or tuple(t.weight_rows.shape) != (n, *weight.shape[1:]):
        raise ValueError(f"{where}: {tuple(t.weight_rows.shape)} weight rows for a shard of {tuple(weight.shape)}")
    for s, rows in zip(states, t.state_rows, strict=True):
        if tuple(rows.shape) != (n, *s.shape[1:]):
            raise ValueError(f"{where}: optimizer state rows {tuple(rows.shape)} for a shard of {tuple(s.shape)}")
    counters = fused_counters(t.module)[t.name]
    for skey, value in counters.items():
        if skey not in t.fused or t.fused[skey].shape != value.shape:
            raise ValueError(f"{where}: fused optimizer counter {skey!r} missing or of another shape")


def commit_resharded(t: TableLoad) -> None:
    """Rebuild this rank's shard of ``t`` from the ids routed to it: rows ``0..n-1`` in id order.

    The other rows are re-initialised (optimizer state zeroed) when first handed to an id.
    Call :func:`check_resharded` first, on every table: this only writes.
    """
    assert t.ids is not None and t.meta is not None and t.weight_rows is not None
    n = t.ids.numel()
    t.module.id_tables[t.name].state.rebuild(
        t.ids,
        last_step=t.meta[:, 0],
        freq=t.meta[:, 1],
        step=t.step,
        admission_counters=t.counters,
        scores=t.scores,
        score_counters=t.score_counters,
        score_ref=t.score_ref,
    )
    weight, states = t.module.table_views()[t.name]
    with torch.no_grad():
        weight[:n].copy_(t.weight_rows)
        for s, rows in zip(states, t.state_rows, strict=True):
            s[:n].copy_(rows)
        for skey, value in fused_counters(t.module)[t.name].items():
            value.copy_(t.fused[skey])
