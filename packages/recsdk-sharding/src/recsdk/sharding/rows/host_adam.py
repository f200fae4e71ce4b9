"""Adam for the fused CPU kernel, which fbgemm does not provide.

fbgemm's CPU kernel updates rows in backward with SGD, Adagrad or row-wise Adagrad only. For a
table whose in-backward optimizer is Adam, recsdk runs that kernel with exact SGD at learning
rate 1 (so each touched row becomes ``w - g``), recovers the row gradient ``g`` as the
difference, and applies Adam to those rows at the end of the same backward pass: a lazy
(sparse) Adam, as fbgemm's GPU kernel does, with bias correction by a per-table step count.
The recovered gradient is exact up to one float32 rounding of the weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.types import LazyAwaitable
from torchrec.modules.embedding_configs import DataType
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedTensor

from recsdk.sharding._torchrec_compat import optimizers_of, queue_backward_callback
from recsdk.sharding.rows.tbe_views import TableViews

__all__ = ["HostAdam", "HostAdamOptimizer", "HostAdamTable", "adam_params_from_fused", "is_adam"]

_ADAM_KEYS = ("learning_rate", "lr", "betas", "beta1", "beta2", "eps", "weight_decay", "optimizer")


def is_adam(fused_params: dict[str, Any]) -> bool:
    """Whether a table's fused params ask for (non-partial, non-row-wise) Adam."""
    opt = fused_params.get("optimizer")
    name = str(getattr(opt, "value", opt) or "").lower()
    return name == "adam"


def adam_params_from_fused(fused_params: dict[str, Any]) -> dict[str, Any]:
    """Adam hyper-parameters from TorchRec fused params (torch-style ``betas`` or ``beta1/beta2``)."""
    betas = fused_params.get("betas", (fused_params.get("beta1", 0.9), fused_params.get("beta2", 0.999)))
    return {
        "lr": float(fused_params.get("learning_rate", fused_params.get("lr", 0.001))),
        "betas": (float(betas[0]), float(betas[1])),
        "eps": float(fused_params.get("eps", 1e-8)),
        "weight_decay": float(fused_params.get("weight_decay", 0.0)),
    }


def as_sgd_lr1(fused_params: dict[str, Any]) -> dict[str, Any]:
    """The fused params that make the CPU kernel apply ``w -= g`` instead of Adam."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    out = {k: v for k, v in fused_params.items() if k not in _ADAM_KEYS}
    out["optimizer"] = EmbOptimType.EXACT_SGD
    out["learning_rate"] = 1.0
    return out


@dataclass
class HostAdamTable:
    """Adam state of one local table shard.

    Attributes:
        weight (torch.Tensor): the fused kernel's ``[rows, dim]`` weight view.
        exp_avg (torch.Tensor): first moment, ``[rows, dim]``.
        exp_avg_sq (torch.Tensor): second moment, ``[rows, dim]``.
        step (torch.Tensor): number of Adam steps taken (scalar int64).
    """

    weight: torch.Tensor
    exp_avg: torch.Tensor = field(init=False)
    exp_avg_sq: torch.Tensor = field(init=False)
    step: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.exp_avg = torch.zeros_like(self.weight)
        self.exp_avg_sq = torch.zeros_like(self.weight)
        self.step = torch.zeros((), dtype=torch.int64)


class HostAdamOptimizer(KeyedOptimizer):
    """The ``fused_optimizer`` face of recsdk's CPU Adam: state, ``param_groups`` and ``lr``.

    ``step()`` does nothing: the update runs in backward, as for every fused optimizer. Change
    ``param_groups[0]["lr"]`` (e.g. with a scheduler) to change the learning rate.

    Args:
        params (dict[str, torch.Tensor]): ``"embedding_bags.<table>.weight"`` -> the parameter
            TorchRec's fused optimizer exposed for that table.
        tables (dict[str, HostAdamTable]): table name -> its Adam state.
        hyper (dict): ``lr``, ``betas``, ``eps``, ``weight_decay``.
    """

    def __init__(self, params: dict[str, Any], tables: dict[str, HostAdamTable], hyper: dict[str, Any]) -> None:
        state: dict[Any, Any] = {}
        for key, param in params.items():
            name = key.split(".")[1]
            t = tables[name]
            state[param] = {f"{name}.exp_avg": t.exp_avg, f"{name}.exp_avg_sq": t.exp_avg_sq, f"{name}.step": t.step}
        super().__init__(params, state, [{"params": list(params.values()), **hyper}])
        self._tables = tables

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass

    def step(self, closure: Any = None) -> None:
        pass

    def apply(self, snapshots: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Adam on the rows the kernel just moved by ``-g`` (``snapshots``: table -> (rows, old rows))."""
        group = next(iter(self.param_groups))
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        with torch.no_grad():
            for name, (rows, old) in snapshots.items():
                t = self._tables[name]
                grad = old - t.weight[rows]
                if wd != 0:
                    grad = grad + wd * old
                t.step += 1
                step = int(t.step)
                m = t.exp_avg[rows].mul_(beta1).add_(grad, alpha=1 - beta1)
                v = t.exp_avg_sq[rows].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                t.exp_avg[rows] = m
                t.exp_avg_sq[rows] = v
                denom = (v / (1 - beta2**step)).sqrt_().add_(eps)
                t.weight[rows] = old - lr * (m / (1 - beta1**step)) / denom


Snapshots = dict[str, tuple[torch.Tensor, torch.Tensor]]


class HostAdam:
    """recsdk's Adam on the fused CPU kernel, for one sharded module: its whole life cycle.

    1. :meth:`plan` (before the module builds its kernels): which tables ask for Adam, and their
       hyper-parameters; :meth:`rewrite` then gives those tables' kernels exact SGD at lr 1.
    2. :meth:`install` (once the kernels exist): Adam state per table, and the module's fused
       optimizer with :class:`HostAdamOptimizer` in place of those tables' SGD.
    3. :meth:`watch` (per training batch, once its lookups are issued, before backward):
       snapshots the batch's rows (the forward lookup does not write them) and applies Adam to
       them at the end of the same backward.

    A plan with no Adam table (or on a device whose kernel has Adam) does nothing anywhere.

    Args:
        hyper (Mapping[str, dict]): table name -> Adam hyper-parameters (``lr``, ``betas``, ...).

    Example::

        adam = HostAdam.plan(grouped_sharding_infos, emulate=device.type == "cpu")
        adam.rewrite(grouped_sharding_infos)             # in create_grouped_sharding_infos
        optimizer = adam.install(fused_optimizer, views) # after the kernels exist
        adam.watch(awaitable, ctx.batch_rows)            # per batch, in compute_and_output_dist
    """

    def __init__(self, hyper: Mapping[str, dict[str, Any]]) -> None:
        self._hyper = dict(hyper)
        self._tables: dict[str, HostAdamTable] = {}
        self._optimizers: dict[str, HostAdamOptimizer] = {}

    @classmethod
    def plan(cls, infos: Mapping[str, list[EmbeddingShardingInfo]], emulate: bool) -> HostAdam:
        """The tables of ``infos`` (TorchRec's grouped sharding infos) that ask for Adam.

        Args:
            infos (Mapping[str, list[EmbeddingShardingInfo]]): sharding type -> infos.
            emulate (bool): whether the kernel lacks Adam (the CPU kernel does).

        Raises:
            ValueError: an Adam table whose weights are not FP32 (named).
        """
        hyper = {}
        if emulate:
            for group in infos.values():
                for info in group:
                    if info.fused_params and is_adam(info.fused_params):
                        config = info.embedding_config
                        if config.data_type != DataType.FP32:
                            raise ValueError(
                                f"table {config.name!r}: Adam on the CPU kernel needs FP32 weights, got "
                                f"data_type={config.data_type.name} (recsdk's CPU Adam recovers each row's "
                                "gradient from the kernel's SGD step, which a lower precision rounds away); "
                                "use DataType.FP32, or RowWiseAdagrad/Adagrad/SGD with FP16 tables"
                            )
                        hyper[config.name] = adam_params_from_fused(info.fused_params)
        return cls(hyper)

    @property
    def tables(self) -> list[str]:
        """Names of the tables this emulation updates."""
        return list(self._hyper)

    def rewrite(self, infos: Mapping[str, list[EmbeddingShardingInfo]]) -> None:
        """Give the planned tables' kernels exact SGD at learning rate 1 (in place)."""
        for group in infos.values():
            for info in group:
                if info.embedding_config.name in self._hyper and info.fused_params:
                    info.fused_params = as_sgd_lr1(info.fused_params)

    def install(self, fused: CombinedOptimizer, views: Mapping[str, TableViews]) -> CombinedOptimizer:
        """The module's fused optimizer with :class:`HostAdamOptimizer` for the planned tables.

        Args:
            fused (CombinedOptimizer): the module's fused optimizer as TorchRec built it.
            views (Mapping[str, TableViews]): the kernel's views (their weights are updated).
        """
        if not self._hyper:
            return fused
        kept: list[tuple[str, KeyedOptimizer]] = []
        for key, opt in optimizers_of(fused):
            names = {k.split(".")[1] for k in opt.params} & set(self._hyper)
            if not names:
                kept.append((key, opt))
                continue
            tables = {name: HostAdamTable(views[name].weight) for name in names}
            adam = HostAdamOptimizer(dict(opt.params), tables, self._hyper[next(iter(names))])
            self._tables.update(tables)
            self._optimizers.update(dict.fromkeys(names, adam))
            kept.append((key, adam))
        return CombinedOptimizer(kept)

    def views(self, views: Mapping[str, TableViews]) -> dict[str, TableViews]:
        """The kernel's views with the Adam moments as the planned tables' optimizer states."""
        out = dict(views)
        for name, t in self._tables.items():
            out[name] = TableViews(t.weight, [t.exp_avg, t.exp_avg_sq])
        return out

    def watch(self, awaitable: LazyAwaitable[Any], batch_rows: Mapping[str, torch.Tensor]) -> None:
        """Apply Adam to the batch's rows once its backward has run the kernel's SGD step.

        Call in training with gradients enabled, after the lookups were issued and before the
        backward (the kernel's SGD step, which :meth:`HostAdam` undoes, runs in the backward).

        Args:
            awaitable (LazyAwaitable): the module's output of ``compute_and_output_dist``.
            batch_rows (Mapping[str, torch.Tensor]): per table, the rows the batch looks up.
        """
        if not self._tables:
            return
        snapshots: Snapshots = {}
        for name, rows in batch_rows.items():
            if name in self._tables and rows.numel() > 0:
                rows = torch.unique(rows)
                snapshots[name] = (rows, self._tables[name].weight[rows].clone())
        if snapshots:
            awaitable.callbacks.append(lambda out: self._hook(out, snapshots))

    def _hook(self, out: Any, snapshots: Snapshots) -> Any:
        # A pooled module returns a KeyedTensor, an unpooled one a dict of JaggedTensors.
        tensors = [out.values()] if isinstance(out, KeyedTensor) else [jt.values() for jt in out.values()]
        queued = False

        def on_grad(grad: torch.Tensor) -> None:
            # Runs when an output's gradient is ready, before the kernel's backward; the queued
            # callback runs once the whole backward (and the kernel's update) is done.
            nonlocal queued
            if not queued:
                queued = True
                queue_backward_callback(lambda: self._apply(snapshots))

        for tensor in tensors:
            if tensor.requires_grad:
                tensor.register_hook(on_grad)
        return out

    def _apply(self, snapshots: Snapshots) -> None:
        by_optimizer: dict[int, tuple[HostAdamOptimizer, Snapshots]] = {}
        for name, snap in snapshots.items():
            opt = self._optimizers[name]
            by_optimizer.setdefault(id(opt), (opt, {}))[1][name] = snap
        for opt, snaps in by_optimizer.values():
            opt.apply(snaps)
