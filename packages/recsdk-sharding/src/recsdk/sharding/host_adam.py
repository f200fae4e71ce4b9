"""Adam for the fused CPU kernel, which fbgemm does not provide.

fbgemm's CPU kernel updates rows in backward with SGD, Adagrad or row-wise Adagrad only. For a
table whose in-backward optimizer is Adam, recsdk runs that kernel with exact SGD at learning
rate 1 (so each touched row becomes ``w - g``), recovers the row gradient ``g`` as the
difference, and applies Adam to those rows at the end of the same backward pass: a lazy
(sparse) Adam, as fbgemm's GPU kernel does, with bias correction by a per-table step count.
The recovered gradient is exact up to one float32 rounding of the weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torchrec.optim.keyed import KeyedOptimizer

__all__ = ["HostAdamOptimizer", "HostAdamTable", "adam_params_from_fused", "is_adam"]

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
