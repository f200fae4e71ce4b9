"""``ModelSpec``: what ``python -m recsdk.serving serve --model package.module:factory`` serves.

The server does not know the user's model: ``factory()`` returns a :class:`ModelSpec` holding the
model (built as for training) and how a request becomes its input and its output becomes
scores.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["ModelSpec", "load_factory"]

Predict = Callable[[Callable[..., Any], KeyedJaggedTensor, torch.Tensor], torch.Tensor]


def _call_with_sparse_and_dense(model: Callable[..., Any], sparse: KeyedJaggedTensor, dense: torch.Tensor) -> Any:
    return model(sparse, dense)


@dataclass
class ModelSpec:
    """A model to serve and how requests reach it.

    Args:
        model (nn.Module): the model, built as for training (unsharded, on CPU), with its
            ``HashEmbeddingBagCollection`` / ``HashEmbeddingCollection`` modules; the server
            wraps it in a :class:`~recsdk.serving.ServingModel` per replica.
        features (Sequence[str]): the sparse features, in the order of the KJT the model takes.
        dense_width (int): dense floats per sample.
        predict (Callable): ``predict(model, sparse, dense) -> scores [B]``: calls the served
            model (in eval mode, under no_grad, one version held through the call) with its own
            input built from the KJT and the dense tensor ``[B, dense_width]``, and returns one
            score per sample. Default: ``model(sparse, dense)``.
        max_batch (int): the most samples a request may carry (413 above it).

    Example::

        def factory() -> ModelSpec:
            model = DLRM(tables, dense_in=13)
            return ModelSpec(
                model, features=["user", "item"], dense_width=13,
                predict=lambda model, sparse, dense: model(Batch(dense, sparse, torch.zeros(len(dense))))[1],
            )
    """

    model: nn.Module
    features: Sequence[str]
    dense_width: int
    predict: Predict = field(default=_call_with_sparse_and_dense)
    max_batch: int = 4096

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise TypeError(f"ModelSpec.model must be an nn.Module, got {type(self.model).__name__}")
        if isinstance(self.features, str) or not self.features or not all(isinstance(f, str) for f in self.features):
            raise ValueError(f"ModelSpec.features must be a non-empty list of feature names, got {self.features!r}")
        if len(set(self.features)) != len(self.features):
            raise ValueError(f"ModelSpec.features repeats a name: {list(self.features)}")
        for name, low in (("dense_width", 0), ("max_batch", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"ModelSpec.{name} must be an int >= {low}, got {value!r}")
        if not callable(self.predict):
            raise TypeError(f"ModelSpec.predict must be callable, got {type(self.predict).__name__}")
        self.features = list(self.features)


def load_factory(target: str) -> Callable[[], ModelSpec]:
    """The factory named ``package.module:function`` (imported; not called).

    Raises:
        ValueError: ``target`` is not ``module:function``, the module does not import, or it has no
            such callable.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model must be 'package.module:factory', got {target!r}")
    try:
        factory = pkgutil.resolve_name(target)  # imports the module, then looks the name up
    except ImportError as e:
        raise ValueError(f"--model {target!r}: module {module_name!r} does not import: {e}") from e
    except AttributeError:
        factory = None
    if not callable(factory):
        raise ValueError(f"--model {target!r}: module {module_name!r} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]


def build_spec(target: str) -> ModelSpec:
    """``factory()`` of :func:`load_factory`, checked to be a :class:`ModelSpec`."""
    spec = load_factory(target)()
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"--model {target!r}: the factory returned {type(spec).__name__}, not a ModelSpec")
    return spec
