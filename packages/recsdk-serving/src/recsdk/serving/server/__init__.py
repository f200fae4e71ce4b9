"""The network server of ``python -m recsdk.serving serve`` (on Ray Serve) and its client.

Importing this package imports no engine: the client (:func:`score`, :class:`ServingClient`),
the request codec and :class:`ModelSpec` need only the standard library and torch. The server
itself (``launch``, ``deployment``, ``metrics``) needs ``recsdk-serving[server]`` (Ray Serve).

| module | holds |
|---|---|
| ``codec`` | requests and answers: JSON and binary, decoded and checked (4xx naming the field) |
| ``model_spec`` | ``ModelSpec``: the model, its features, dense width and ``predict`` |
| ``replica`` | ``Replica``: a ``ServingModel`` following ROOT, the answer to a body, health |
| ``merge`` | several decoded requests as one forward's batch, and its scores cut back per request |
| ``metrics`` | the replica's metrics in Ray Serve's metrics system |
| ``deployment`` | the Ray Serve deployment and the health board (a Ray actor) |
| ``launch`` | ``serve``: Ray and the replicas started on this machine |
| ``client`` | ``score``, ``ServingClient`` |
"""

from recsdk.serving.server.client import Scores, ServerError, ServingClient, score
from recsdk.serving.server.codec import RequestError, decode_request, encode_request
from recsdk.serving.server.model_spec import ModelSpec

__all__ = [
    "ModelSpec",
    "RequestError",
    "Scores",
    "ServerError",
    "ServingClient",
    "decode_request",
    "encode_request",
    "score",
]
