"""A client that pushes items through steadyserve's /infer at the pace the server can take.

Runs on orchestrator machines: imports neither torch nor the model. ``steadyserve batch``
is its command line (``app.batchclient.cli``); ``BatchClient`` and ``SyncBatchClient`` are
its Python API.
"""

from app.batchclient.client import BatchClient, ClientRefused
from app.batchclient.items import Failure, Item, Result, Success
from app.batchclient.options import ClientOptions
from app.batchclient.retry import RetryPolicy
from app.batchclient.stats import BatchStats
from app.batchclient.sync import SyncBatchClient

__all__ = [
    "BatchClient",
    "BatchStats",
    "ClientOptions",
    "ClientRefused",
    "Failure",
    "Item",
    "Result",
    "RetryPolicy",
    "Success",
    "SyncBatchClient",
]
