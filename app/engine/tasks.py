"""Which host serves each task (`ModelSpec.task`): the one table a new task is added to."""

from __future__ import annotations

from app.engine.embedding_host import load_embedding_host
from app.engine.generation_loading import load_generation_host
from app.engine.host import HostFactory
from app.engine.tensor_host import load_tensor_host

HOST_FACTORIES: dict[str, HostFactory] = {
    "embed": load_embedding_host,
    "tensor": load_tensor_host,
    "generate": load_generation_host,
}
