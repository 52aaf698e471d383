"""The ZeroMQ data bus: producers hold tensors in local stores, consumers fetch by reference.

Producer::

    server = serve_store(BusConfig())          # a TensorStore behind a ROUTER socket
    ref = server.store.put("step3/p17/s4/latents", "latents", array, policy_version=3)

Consumer (any process; same host -> shared memory, same process -> no socket at all)::

    with BusClient(BusConfig()) as client:
        [latents] = client.fetch([ref], timeout_s=30)

Torch tensors of every dtype: ``flowgrpo.bus.torch_tensors`` (imports torch; this package
does not). Wire format: ``flowgrpo.bus.wire``; who may connect (CURVE keys derived from
FLOWGRPO_BUS_SECRET): ``flowgrpo.bus.auth``; what a connection may make a store buffer:
``flowgrpo.bus.guard``.
"""

from flowgrpo.bus.client import BusClient
from flowgrpo.bus.config import BusConfig
from flowgrpo.bus.dtypes import storage_dtype
from flowgrpo.bus.errors import (
    BusError,
    DataLost,
    ErrorCode,
    Evicted,
    Internal,
    InvalidRequest,
    NotFound,
    Released,
    StoreFull,
    Unauthenticated,
)
from flowgrpo.bus.refs import Fetched, TensorBytes, TensorRef
from flowgrpo.bus.server import BusServer, serve_store
from flowgrpo.bus.store import TensorStore
from flowgrpo.bus.wire import StoreInfo

__all__ = [
    "BusClient",
    "BusConfig",
    "BusError",
    "BusServer",
    "DataLost",
    "ErrorCode",
    "Evicted",
    "Fetched",
    "Internal",
    "InvalidRequest",
    "NotFound",
    "Released",
    "StoreFull",
    "StoreInfo",
    "TensorBytes",
    "TensorRef",
    "TensorStore",
    "Unauthenticated",
    "serve_store",
    "storage_dtype",
]
