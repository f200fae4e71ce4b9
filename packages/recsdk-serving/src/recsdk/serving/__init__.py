"""recsdk-serving: a model trained by recsdk, served in one process from its published versions.

``ServingModel(model, root)`` replaces the model's hash collections with read-only
``ServingEmbeddingBagCollection`` / ``ServingEmbeddingCollection`` modules (raw int64 ids through
FBGEMM's hash index into FBGEMM's inference lookup), loads the dense part, and applies newer
versions in place (``refresh``, ``follow``). Requires recsdk-embedding only: no process group.

``python -m recsdk.serving serve ROOT --model package.module:factory`` serves a :class:`ModelSpec`
over HTTP on Ray Serve (``recsdk-serving[server]``); :func:`score` and :class:`ServingClient`
are its client. Importing ``recsdk.serving`` imports no engine.
"""

from recsdk.serving.rw_lock import ReadWriteLock
from recsdk.serving.served_table import ServedTable
from recsdk.serving.server import ModelSpec, RequestError, Scores, ServerError, ServingClient, score
from recsdk.serving.serving_collections import (
    ServingEmbeddingBagCollection,
    ServingEmbeddingCollection,
    StagedVersion,
)
from recsdk.serving.serving_model import ServingModel

__all__ = [
    "ModelSpec",
    "ReadWriteLock",
    "RequestError",
    "Scores",
    "ServedTable",
    "ServerError",
    "ServingClient",
    "ServingEmbeddingBagCollection",
    "ServingEmbeddingCollection",
    "ServingModel",
    "StagedVersion",
    "score",
]
