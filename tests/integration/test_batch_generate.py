"""`steadyserve batch` against a generate model: the tiny random-weight causal LM served by
the real server (engine in process, uvicorn on 127.0.0.1 in the test's loop) and the batch
CLI's job (`run_job`, as `main` runs it) on 12 lines of different lengths. Lines sharing
their parameters are packed into shared /infer requests, a seeded line goes alone, lines
with stop strings and log probabilities are packed too, and each result line equals what
/infer answers for that line alone: its texts, finish reasons, token counts, log
probabilities and usage (the line's own tokens, from its outputs' counts)."""

from __future__ import annotations

import io
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio

from app.batchclient.cli import parse_arguments, run_job
from app.main import create_app
from loadtest.tiny_causal_lm import CORPUS
from tests.support.generation import generate_settings
from tests.support.generation_api import SLOT_TOKENS, SLOTS
from tests.support.listening import listening

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = {"max_new_tokens": 9}
LONGER = {"max_new_tokens": 14}
LOGPROBS = {"max_new_tokens": 7, "logprobs": 2}
SEEDED = {"max_new_tokens": 10, "do_sample": True, "temperature": 1.5, "seed": 7}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def base_url(tiny_causal_lm: Path) -> AsyncIterator[str]:
    settings = generate_settings(
        {"tiny": tiny_causal_lm}, slots=SLOTS, slot_tokens=SLOT_TOKENS, engine="inprocess"
    )
    async with listening(create_app(settings)) as url:
        yield url


async def alone(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/infer", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def lines(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    """12 lines: 6 greedy ones of different lengths (two with two prompts), packed; 2 with
    more new tokens, packed apart; 2 with a stop string their text reaches, 1 with log
    probabilities and a deadline; 1 seeded sample, sent alone."""
    prompts = [text[:cut] for text in CORPUS[:6] for cut in (11, 70)]
    stop_prompt = CORPUS[7][:30]
    unstopped = await alone(client, {"inputs": stop_prompt, "parameters": LONGER})
    stop = unstopped["outputs"][0]["text"][4:7]  # its greedy text reaches this
    assert stop.strip(), unstopped
    stopping = {**LONGER, "stop": [stop]}
    return [
        {"id": "g1", "inputs": prompts[0], "parameters": GREEDY},
        {"id": "g2", "inputs": [prompts[1], prompts[2]], "parameters": GREEDY},
        {"id": "g3", "inputs": prompts[3], "parameters": GREEDY},
        {"id": "g4", "inputs": prompts[4], "parameters": GREEDY},
        {"id": "g5", "inputs": [prompts[5], prompts[6], prompts[7]], "parameters": GREEDY},
        {"id": "g6", "inputs": prompts[8], "parameters": GREEDY},
        {"id": "l1", "inputs": prompts[9], "parameters": LONGER},
        {"id": "l2", "inputs": prompts[10], "parameters": LONGER},
        {"id": "s1", "inputs": stop_prompt, "parameters": stopping},
        {"id": "s2", "inputs": [prompts[11], stop_prompt], "parameters": stopping},
        {"id": "p1", "inputs": [CORPUS[8], CORPUS[9][:20]], "parameters": LOGPROBS,
         "timeout_ms": 60_000},
        {"id": "seeded", "inputs": CORPUS[6][:25], "parameters": SEEDED},
    ]  # fmt: skip


def same_logprobs(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> bool:
    """Equal tokens; log probabilities equal up to a batched forward's last bits."""
    if len(got) != len(expected):
        return False
    for token, other in zip(got, expected, strict=True):
        if token["token"] != other["token"] or token["token_id"] != other["token_id"]:
            return False
        if not math.isclose(token["logprob"], other["logprob"], abs_tol=1e-4):
            return False
    return True


def assert_same_answer(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got["model"] == expected["model"]
    assert got["usage"] == expected["usage"], (got, expected)
    assert len(got["outputs"]) == len(expected["outputs"]), (got, expected)
    for output, other in zip(got["outputs"], expected["outputs"], strict=True):
        plain = {k: v for k, v in output.items() if k != "logprobs"}
        assert plain == {k: v for k, v in other.items() if k != "logprobs"}, (got, expected)
        assert ("logprobs" in output) == ("logprobs" in other)
        if "logprobs" in output:
            assert same_logprobs(output["logprobs"], other["logprobs"]), (got, expected)


async def test_each_result_line_is_the_lines_answer_alone(
    client: httpx.AsyncClient, base_url: str, tmp_path: Path
) -> None:
    items = await lines(client)
    source, out, summary = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "sum.json"
    source.write_bytes(b"".join(orjson.dumps(item) + b"\n" for item in items))
    command = [str(source), "--url", base_url, "--out", str(out), "--progress", "lines"]
    command += ["--inputs-per-request", "6", "--summary-json", str(summary)]
    assert await run_job(parse_arguments(command), io.StringIO()) == 0
    results = {line["id"]: line for line in map(orjson.loads, out.read_bytes().splitlines())}
    assert sorted(results) == sorted(item["id"] for item in items)
    # Packed: g1-g4 (5 prompts; g5 would make 8), g5-g6, l1-l2, s1-s2, p1 and the seeded line alone.
    assert orjson.loads(summary.read_bytes())["requests"] == 6
    for item in items:
        body = {k: v for k, v in item.items() if k != "id"}
        assert_same_answer(results[item["id"]], await alone(client, body))
    assert {o["finish_reason"] for o in results["s1"]["outputs"]} == {"stop"}
    assert results["p1"]["outputs"][0]["logprobs"], results["p1"]


async def test_a_line_past_its_deadline_fails_and_the_others_are_answered(
    base_url: str, tmp_path: Path
) -> None:
    """A generate line answered 504 on every try goes to the errors file once its deadline
    retries are spent (`--max-deadline-retries`, 2: three answers), with the reason."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    late = {"id": "late", "inputs": CORPUS[0], "parameters": GREEDY, "timeout_ms": 0.001}
    on_time = {"id": "on-time", "inputs": CORPUS[1], "parameters": GREEDY}
    source.write_bytes(orjson.dumps(late) + b"\n" + orjson.dumps(on_time) + b"\n")
    command = [str(source), "--url", base_url, "--out", str(out), "--progress", "lines"]
    command += ["--inputs-per-request", "4"]
    assert await run_job(parse_arguments(command), io.StringIO()) == 3  # some lines failed
    answered = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [line["id"] for line in answered] == ["on-time"]
    assert answered[0]["usage"]["output_tokens"] == answered[0]["outputs"][0]["completion_tokens"]
    (failed,) = map(orjson.loads, (tmp_path / "out.errors.jsonl").read_bytes().splitlines())
    assert (failed["id"], failed["status"], failed["attempts"]) == ("late", 504, 3)
    assert failed["error"]["code"] == "deadline"
    assert failed["reason"].startswith("answered 504 3 times"), failed
