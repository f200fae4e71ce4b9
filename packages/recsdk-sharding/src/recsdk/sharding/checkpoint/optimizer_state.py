"""The optimizer's part of a checkpoint: the state of every parameter but the hash tables', and
every parameter group's hyperparameters.

The hash tables' fused optimizer state is part of the tables (see ``save``). The rest is saved
per state entry by kind: ``"sharded"`` (a ShardedTensor, which DCP reshards), ``"tensor"`` or
``"object"`` (pickled); the hyperparameters (learning rates a scheduler set included) are
pickled by parameter key. Loading stages everything first (:func:`targets`, :func:`decode`)
and changes the optimizer only in :func:`apply`.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, OptimizerWrapper

from recsdk.sharding import _torchrec_compat as compat
from recsdk.sharding.checkpoint.manifest import optim_key
from recsdk.sharding.checkpoint.storage import empty_like_saved
from recsdk.sharding.writing.hash_modules import HashModule

__all__ = [
    "PARAM_GROUPS_KEY",
    "DecodedOptimizer",
    "apply",
    "check_optimizer",
    "collect",
    "decode",
    "hash_param_ids",
    "targets",
]

PARAM_GROUPS_KEY = "optim_param_groups"


def check_optimizer(optimizer: Any) -> None:
    """Raises TypeError unless ``optimizer`` is a torchrec ``KeyedOptimizer`` or None."""
    if optimizer is not None and not isinstance(optimizer, KeyedOptimizer):
        raise TypeError(
            "optimizer must be a torchrec KeyedOptimizer (e.g. CombinedOptimizer([model.fused_optimizer, "
            f"KeyedOptimizerWrapper(...)])) or None, got {type(optimizer).__name__}"
        )


def hash_param_ids(modules: Mapping[str, HashModule]) -> set[int]:
    """``id()`` of every hash table parameter (their state is saved with the tables)."""
    return {id(p) for m in modules.values() for p in m.fused_optimizer.params.values()}


def _leaf_optimizers(optimizer: KeyedOptimizer) -> Iterator[KeyedOptimizer]:
    if isinstance(optimizer, CombinedOptimizer):
        for _, sub in optimizer.optimizers:
            yield from _leaf_optimizers(sub)
    elif isinstance(optimizer, OptimizerWrapper):
        yield from _leaf_optimizers(compat.wrapped_optimizer(optimizer))
    else:
        yield optimizer


def _param_group_hyperparameters(optimizer: KeyedOptimizer) -> dict[str, dict[str, Any]]:
    """Per parameter key, the hyperparameters of its group (everything but ``params``)."""
    key_of = {id(p): k for k, p in optimizer.params.items()}
    out: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        hps = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            key = key_of.get(id(p))
            if key is not None:
                out[key] = hps
    return out


def collect(
    optimizer: KeyedOptimizer, modules: Mapping[str, HashModule], state: dict[str, Any]
) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, Any]]]:
    """Add this rank's optimizer state to the DCP ``state``.

    Returns:
        tuple: the kind of each saved entry (``{param key: {state key: kind}}``, for the
        manifest) and the hyperparameters per parameter key (rank 0 saves their union).
    """
    kinds_of: dict[str, dict[str, str]] = {}
    hash_ids = hash_param_ids(modules)
    params = optimizer.params
    for pkey, pstate in optimizer.state_dict()["state"].items():
        if id(params[pkey]) in hash_ids:
            continue
        kinds = kinds_of.setdefault(pkey, {})
        for skey, value in pstate.items():
            key = optim_key(pkey, skey)
            if compat.is_sharded_tensor(value):
                state[key], kinds[skey] = value, "sharded"
            elif isinstance(value, torch.Tensor):
                state[key], kinds[skey] = value.detach(), "tensor"
            else:
                state[key], kinds[skey] = pickle.dumps(value), "object"
    return kinds_of, _param_group_hyperparameters(optimizer)


def targets(
    optimizer: KeyedOptimizer,
    modules: Mapping[str, HashModule],
    manifest: dict[str, Any],
    reader_md: Mapping[str, Any],
) -> dict[str, Any]:
    """Staging buffers for the saved optimizer state (new tensors; the optimizer's are untouched)."""
    saved: dict[str, dict[str, str]] = manifest["optimizer_state"]
    hash_ids = hash_param_ids(modules)
    current = optimizer.state_dict()["state"]
    out: dict[str, Any] = {}
    for pkey, param in optimizer.params.items():
        if id(param) in hash_ids:
            continue
        for skey, kind in saved.get(pkey, {}).items():
            key = optim_key(pkey, skey)
            if kind == "sharded":
                out[key] = compat.empty_sharded_like(current[pkey][skey])
            elif kind == "tensor":
                out[key] = empty_like_saved(reader_md[key])
            else:
                out[key] = b""
    if PARAM_GROUPS_KEY in reader_md:
        out[PARAM_GROUPS_KEY] = b""
    return out


@dataclass
class DecodedOptimizer:
    """The saved optimizer state, read and unpickled: ``values`` by DCP key, ``param_groups`` by param key."""

    values: dict[str, Any]
    param_groups: dict[str, dict[str, Any]] | None


def decode(manifest: dict[str, Any], loaded: Mapping[str, Any]) -> DecodedOptimizer:
    """Unpickle the read ``"object"`` entries and the hyperparameters (before anything is changed).

    Raises:
        Exception: what ``pickle`` raises on damaged bytes.
    """
    saved: dict[str, dict[str, str]] = manifest["optimizer_state"]
    values: dict[str, Any] = {}
    for pkey, kinds in saved.items():
        for skey, kind in kinds.items():
            key = optim_key(pkey, skey)
            if key not in loaded:
                continue
            values[key] = pickle.loads(loaded[key]) if kind == "object" else loaded[key]
    groups = pickle.loads(loaded[PARAM_GROUPS_KEY]) if PARAM_GROUPS_KEY in loaded else None
    return DecodedOptimizer(values, groups)


def apply(
    optimizer: KeyedOptimizer,
    modules: Mapping[str, HashModule],
    manifest: dict[str, Any],
    decoded: DecodedOptimizer,
) -> None:
    """Replace the optimizer's state (lazily created state included) and hyperparameters; clear gradients."""
    saved: dict[str, dict[str, str]] = manifest["optimizer_state"]
    hash_ids = hash_param_ids(modules)
    leaf_of: dict[int, KeyedOptimizer] = {}
    for leaf in _leaf_optimizers(optimizer):
        for p in leaf.params.values():
            leaf_of[id(p)] = leaf
    for pkey, param in optimizer.params.items():
        if id(param) in hash_ids or id(param) not in leaf_of:
            continue
        leaf = leaf_of[id(param)]
        kinds = saved.get(pkey, {})
        if not kinds:
            leaf.state.pop(param, None)
            continue
        if param not in leaf.state:
            leaf.state[param] = {}
        pstate = leaf.state[param]
        for skey in [k for k in pstate if k not in kinds]:
            del pstate[skey]
        for skey, kind in kinds.items():
            value = decoded.values[optim_key(pkey, skey)]
            if kind == "sharded":
                compat.copy_sharded_(pstate[skey], value)
            elif kind == "object":
                pstate[skey] = value
            else:
                old = pstate.get(skey)
                if isinstance(old, torch.Tensor) and old.shape == value.shape and old.dtype == value.dtype:
                    old.detach().copy_(value)
                else:
                    pstate[skey] = value.to(param.device) if isinstance(param, torch.Tensor) else value
    if decoded.param_groups is not None:
        hps = decoded.param_groups
        key_of = {id(p): k for k, p in optimizer.params.items()}
        for group in optimizer.param_groups:
            source = next((hps[key_of[id(p)]] for p in group["params"] if key_of.get(id(p)) in hps), None)
            if source is None:
                continue
            for k in group:
                if k != "params" and k in source:
                    group[k] = pickle.loads(pickle.dumps(source[k]))
    # Pushes restored learning rates into the fused kernels (they read them on zero_grad/step).
    optimizer.zero_grad(set_to_none=True)
