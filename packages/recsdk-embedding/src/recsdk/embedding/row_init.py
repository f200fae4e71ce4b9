"""Re-initialise reused embedding rows and their optimizer state.

When eviction hands a row to a new id, the row still holds the old id's embedding and the
optimizer still holds the old id's statistics. :func:`init_rows_` gives the row a fresh value the
way the table was initialised; :func:`reset_optimizer_rows_` resets the per-row optimizer state.
"""

from __future__ import annotations

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

__all__ = ["init_rows_", "reset_optimizer_rows_"]


@torch.no_grad()
def init_rows_(weight: torch.Tensor, rows: torch.Tensor, config: BaseEmbeddingConfig) -> None:
    """Re-initialise ``weight[rows]`` in place with the table's ``init_fn``.

    ``init_fn`` (TorchRec's default: uniform in ``±sqrt(1 / num_embeddings)``, or the config's
    ``weight_init_min``/``weight_init_max``) is applied to a fresh ``[len(rows), dim]`` tensor that is
    then written to the rows. An ``init_fn`` that depends on the tensor's shape (e.g. fan-in based)
    therefore sees ``len(rows)`` rows instead of ``num_embeddings``.

    Args:
        weight (torch.Tensor): ``[num_rows, dim]`` embedding weights (a parameter, or a view of a
            fused kernel's weights); any device.
        rows (torch.Tensor): integer ``[k]`` rows to re-initialise, on any device.
        config (BaseEmbeddingConfig): the table's config (its ``init_fn`` is used).

    Example::

        init_rows_(ebc.embedding_bags["user"].weight, table.take_reassigned_rows(), config)
    """
    if weight.dim() != 2:
        raise ValueError(f"init_rows_ on table '{config.name}': weight must be 2-D, got shape {tuple(weight.shape)}")
    if rows.is_floating_point() or rows.dtype == torch.bool:
        raise TypeError(f"init_rows_ on table '{config.name}': rows must be integers, got {rows.dtype}")
    rows = rows.reshape(-1).to(device=weight.device, dtype=torch.int64)
    if rows.numel() == 0:
        return
    bad = (rows < 0) | (rows >= weight.shape[0])
    if bool(bad.any()):
        raise ValueError(
            f"init_rows_ on table '{config.name}': rows must be in [0, {weight.shape[0]}), got {int(rows[bad][0])}"
        )
    init_fn = config.init_fn
    if init_fn is None:
        raise ValueError(f"init_rows_ on table '{config.name}': the config has no init_fn")
    fresh = torch.empty(rows.numel(), weight.shape[1], dtype=weight.dtype, device=weight.device)
    init_fn(fresh)
    weight.index_copy_(0, rows, fresh)


@torch.no_grad()
def reset_optimizer_rows_(optimizer: torch.optim.Optimizer, param: torch.Tensor, rows: torch.Tensor) -> None:
    """Reset a plain torch optimizer's per-row state of ``param`` at ``rows``, as for a fresh row.

    Every state tensor of ``param`` whose first dimension equals ``param``'s (Adagrad's ``sum``,
    SGD's ``momentum_buffer``, Adam's ``exp_avg``/``exp_avg_sq``, ...) is reset at ``rows``: to the
    group's ``initial_accumulator_value`` for Adagrad's ``sum``, to zero otherwise. Scalar state
    (such as ``step``) is shared by all rows and left alone. For SGD with momentum the next update of
    a reset row equals a fresh row's when ``dampening`` is 0.

    Args:
        optimizer (torch.optim.Optimizer): the optimizer holding ``param``.
        param (torch.Tensor): the ``[num_rows, dim]`` embedding weight.
        rows (torch.Tensor): integer ``[k]`` rows.

    Example::

        reset_optimizer_rows_(opt, ebc.embedding_bags["user"].weight, rows)
    """
    rows = rows.reshape(-1).to(device=param.device, dtype=torch.int64)
    if rows.numel() == 0 or param not in optimizer.state:
        return
    initial = 0.0
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            initial = float(group.get("initial_accumulator_value", 0.0))
    for key, value in optimizer.state[param].items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == param.shape[0]:
            fill = initial if key == "sum" else 0.0
            value.index_fill_(0, rows.to(value.device), fill)
