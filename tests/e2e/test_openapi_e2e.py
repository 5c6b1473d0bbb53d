"""The OpenAPI document is accurate: schemathesis fuzzes a real server process from it with
every check, and the three findings of its first run stay fixed (/metrics is Prometheus
text, `dimensions` is what the server accepts, the list limit is stated); every error the
code answers is documented."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.deploy.tools import require_tool
from tests.support.answered_errors import answered_error_types
from tests.support.server import ServerProcess, running_server

pytestmark = pytest.mark.e2e

CONFIG = Path(__file__).with_name("schemathesis.toml")
MAX_INPUTS = 8
# Bounded: ~600 generated requests, a few seconds against a warm server; a fixed seed so a
# failure reproduces (`st replay` is printed with it).
MAX_EXAMPLES = 200
SEED = 20250611


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {"STEADY_MAX_INPUTS_PER_REQUEST": str(MAX_INPUTS)}
    with running_server(tmp_path_factory.mktemp("openapi"), env) as process:
        yield process


def test_schemathesis_finds_nothing_with_every_check(server: ServerProcess, tmp_path: Path) -> None:
    schemathesis = require_tool("schemathesis")
    command = [
        schemathesis, "--config-file", str(CONFIG), "--no-color",
        "run", f"{server.base_url}/openapi.json",
        "--checks", "all", "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED),
        "--workers", "2", "--generation-database", "none", "--request-timeout", "30",
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-8000:]
    # The operations the document states (/v1/models/{model} the seventh; the tokenizer
    # routes /tokenize, /detokenize and /tokenizer_info the last three).
    assert "10 selected / 10 total" in output, output[-2000:]


def test_metrics_are_documented_as_the_prometheus_text_they_are(server: ServerProcess) -> None:
    document = httpx.get(f"{server.base_url}/openapi.json").json()
    documented = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    answered = httpx.get(f"{server.base_url}/metrics").headers["content-type"]
    assert list(documented) == ["text/plain"]
    assert answered.startswith("text/plain")


def test_dimensions_accepts_exactly_what_the_server_accepts(server: ServerProcess) -> None:
    document = httpx.get(f"{server.base_url}/openapi.json").json()
    schemas = document["components"]["schemas"]
    dimensions = schemas["EmbeddingsRequest"]["properties"]["dimensions"]["anyOf"]
    allowed = next(variant["enum"] for variant in dimensions if variant.get("type") == "integer")
    assert allowed == [384]  # all-MiniLM-L6-v2's width
    url = f"{server.base_url}/v1/embeddings"
    accepted = httpx.post(url, json={"input": "a", "dimensions": 384}, timeout=30)
    refused = httpx.post(url, json={"input": "a", "dimensions": 383}, timeout=30)
    assert accepted.status_code == 200 and len(accepted.json()["data"][0]["embedding"]) == 384
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"


def test_the_input_list_limit_is_the_setting(server: ServerProcess) -> None:
    schemas = httpx.get(f"{server.base_url}/openapi.json").json()["components"]["schemas"]
    for component, field in (("InferRequest", "inputs"), ("EmbeddingsRequest", "input")):
        variants = schemas[component]["properties"][field]["anyOf"]
        assert [v["maxItems"] for v in variants if v.get("type") == "array"] == [MAX_INPUTS]
    too_many = httpx.post(
        f"{server.base_url}/infer", json={"inputs": ["a"] * (MAX_INPUTS + 1)}, timeout=30
    )
    assert too_many.status_code == 413


# Error types the code answers that are not answers of the inference routes themselves,
# so their operations need not document them.
NOT_ANSWERED_BY_INFERENCE_ROUTES = {
    "unauthorized",  # /debug's bearer token
    "not_found",  # a path the server does not have
    "method_not_allowed",  # a method the path does not take
    "client_closed_request",  # logged for a client that has gone: nobody receives it
}


def test_every_error_status_is_documented_with_when_it_happens(server: ServerProcess) -> None:
    """Every (status, error type) the code answers, found by reading the code (as the
    README's error table is checked), is a documented status of each inference route whose
    description names the type: a status the middleware answers (408, 415) or a new one
    dropped from the document fails here."""
    answered = answered_error_types()
    stale = NOT_ANSWERED_BY_INFERENCE_ROUTES - {kind for _, kind in answered}
    assert not stale, stale
    expected = {pair for pair in answered if pair[1] not in NOT_ANSWERED_BY_INFERENCE_ROUTES}
    assert {408, 415} <= {status for status, _ in expected}  # the scan found the middleware's
    paths = httpx.get(f"{server.base_url}/openapi.json").json()["paths"]
    for path in ("/infer", "/v1/embeddings"):
        responses = paths[path]["post"]["responses"]
        for status, kind in sorted(expected):
            assert str(status) in responses, (path, status)
            assert f"`{kind}`" in responses[str(status)]["description"], (path, status, kind)
