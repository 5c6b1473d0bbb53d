"""lm-evaluation-harness against steadyserve gives the numbers of its in-process `hf` backend.

`python -m loadtest.lm_eval_check [--lm-eval PATH]` builds the tiny causal LM
(`loadtest/tiny_causal_lm.py`) and three seeded word-salad tasks in a temporary directory
(`ss_mc`: multiple_choice, 24 questions of 4 choices; `ss_gen`: generate_until, 16 prompts,
6 `until` strings; `ss_rolling`: loglikelihood_rolling, 8 documents longer than one
window), starts `steadyserve serve` on a free loopback port with the model as its only
generate model, and runs lm-eval twice over the tasks: `--model local-completions` against
the server (its tokenizer through /tokenizer_info, /tokenize and /detokenize), then
`--model hf` in-process on CPU. It compares the logged samples one by one:

- ss_mc: each choice's loglikelihood within `LL_TOLERANCE` of hf's, and the same greedy flag;
- ss_gen: the same generated text;
- ss_rolling: each document's loglikelihood within `LL_TOLERANCE` of a reference forward
  over the API model's own windows. lm-eval's API model keeps one position for generation
  (its length is `max_length - 1`, 511), so its windows are one token shorter than the hf
  backend's and its rolling numbers differ from hf's for that reason alone; the reference
  (`REFERENCE_CODE`, run by the lm-eval installation's python, which has torch,
  transformers and lm_eval) builds the same windows with `get_rolling_token_windows` and
  `make_disjoint_window` and scores each with one float32 forward of the model.

`add_bos_token=False` for hf: that backend otherwise prepends BOS to every request, which
the remote-tokenizer path does not (lm-eval's own difference, not the server's).

lm-eval is not a dependency of the project (not in `make test`, not in `make bench`):
install it in a venv of its own, see loadtest/README.md. Prints a table; exits 1 on any
mismatch. Needs no network: HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadtest.localserver import free_port, start_serve
from loadtest.tiny_causal_lm import build_tiny_causal_lm

MODEL_NAME = "tiny"
MAX_LENGTH = 512
LL_TOLERANCE = 1e-3
SEED = 20
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dogs", "ran", "over", "bridges", "birds"]
WORDS += ["sang", "near", "rivers", "green", "fields", "old", "stone", "quiet", "through"]
WORDS += ["while", "and"]
UNTIL = ["\n", ".", "?", "!", ";", "river"]
TASKS = ("ss_mc", "ss_rolling", "ss_gen")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

TASK_YAML = {
    "ss_mc": """task: ss_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "ss_rolling": """task: ss_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""",
    "ss_gen": """task: ss_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: {until}
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
""",
}

# Run as `python -c REFERENCE_CODE MODEL_DIR TEXTS_JSON MAX_LENGTH` by the lm-eval
# installation's python; prints [[loglikelihood, windows], ...], one per text.
REFERENCE_CODE = """
import json, sys
import torch
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, texts_path, max_length = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
results = []
for text in json.loads(open(texts_path).read()):
    ids = tokenizer.encode(text, add_special_tokens=False)
    windows = get_rolling_token_windows(
        token_list=ids, prefix_token=tokenizer.bos_token_id,
        max_seq_len=max_length - 1, context_len=1,
    )
    total, count = 0.0, 0
    for context, continuation in map(make_disjoint_window, windows):
        tokens = (context + continuation)[-max_length:]
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        first = len(tokens) - len(continuation)
        for position in range(first, len(tokens)):
            total += logprobs[position - 1, tokens[position]].item()
        count += 1
    results.append([total, count])
print(json.dumps(results))
"""


def _sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def write_tasks(root: Path, seed: int = SEED) -> Path:
    """The three tasks' JSONL data and YAMLs under `root`; the folder of the YAMLs."""
    rng = random.Random(seed)
    data: dict[str, list[dict[str, Any]]] = {
        "ss_mc": [
            {
                "question": _sentence(rng, 4, 12) + " :",
                "choices": [_sentence(rng, 1, 4) for _ in range(4)],
                "answer": rng.randrange(4),
            }
            for _ in range(24)
        ],
        "ss_gen": [
            {"question": _sentence(rng, 5, 10), "answer": _sentence(rng, 2, 2)} for _ in range(16)
        ],
        "ss_rolling": [{"text": _sentence(rng, 300, 450)} for _ in range(8)],
    }
    tasks = root / "tasks"
    tasks.mkdir(parents=True)
    for task, rows in data.items():
        path = root / f"{task}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        text = TASK_YAML[task].format(data=path, until=json.dumps(UNTIL))
        (tasks / f"{task}.yaml").write_text(text)
    return tasks


def run_lm_eval(lm_eval: str, args: list[str], tasks: Path, out: Path, root: Path) -> None:
    """`lm_eval ARGS` over the three tasks, logging samples under `out`; its output to
    `out`.log. Raises CalledProcessError, quoting the log's end, if it fails."""
    command = [lm_eval, *args, "--tasks", ",".join(TASKS), "--include_path", str(tasks)]
    command += ["--output_path", str(out), "--log_samples"]
    env = {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(root / "datasets-cache")}
    log = out.with_suffix(".log")
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    with log.open("wb") as log_file:
        done = subprocess.run(command, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"lm_eval exited with {done.returncode}; the end of {log}:\n{tail}")


def samples(out: Path, task: str) -> list[dict[str, Any]]:
    """The logged samples of `task` under `out`, in doc_id order."""
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    if len(files) != 1:
        raise RuntimeError(f"expected one samples file for {task} under {out}, found {files}")
    rows = [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda row: int(row["doc_id"]))


def _loglikelihoods(row: dict[str, Any]) -> list[tuple[float, bool]]:
    # each choice's resps: [[loglikelihood, is_greedy]], both logged as strings
    return [(float(resp[0][0]), resp[0][1] == "True") for resp in row["resps"]]


def compare_mc(served: list[dict[str, Any]], hf: list[dict[str, Any]]) -> tuple[int, float, int]:
    """(loglikelihoods, the largest absolute difference, greedy flags that differ)."""
    count, worst, flags = 0, 0.0, 0
    for left, right in zip(served, hf, strict=True):
        pairs = zip(_loglikelihoods(left), _loglikelihoods(right), strict=True)
        for (value, greedy), (expected, expected_greedy) in pairs:
            count += 1
            worst = max(worst, abs(value - expected))
            flags += greedy != expected_greedy
    return count, worst, flags


def compare_gen(served: list[dict[str, Any]], hf: list[dict[str, Any]]) -> tuple[int, int]:
    """(texts, texts that differ)."""
    differing = [
        left["doc_id"]
        for left, right in zip(served, hf, strict=True)
        if left["resps"][0][0] != right["resps"][0][0]
    ]
    for doc_id in differing:
        print(f"ss_gen doc {doc_id} differs", file=sys.stderr)
    return len(served), len(differing)


def compare_rolling(
    served: list[dict[str, Any]], python: str, model_dir: Path, root: Path
) -> tuple[int, float, int]:
    """(documents, the largest absolute difference from the reference, its windows)."""
    texts_path = root / "rolling-texts.json"
    texts_path.write_text(json.dumps([row["doc"]["text"] for row in served]))
    command = [python, "-c", REFERENCE_CODE, str(model_dir), str(texts_path)]
    command.append(str(MAX_LENGTH - 1))
    done = subprocess.run(
        command, env={**os.environ, **OFFLINE}, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the rolling reference exited with {done.returncode}:\n{done.stderr}")
    reference = json.loads(done.stdout.strip().splitlines()[-1])
    worst = max(
        abs(float(row["resps"][0][0]) - expected)
        for row, (expected, _) in zip(served, reference, strict=True)
    )
    return len(served), worst, sum(windows for _, windows in reference)


def lm_eval_python(lm_eval: str, given: str | None) -> str:
    """The python of lm-eval's installation: `given`, else the one beside the executable."""
    if given:
        return given
    found = shutil.which(lm_eval)
    if found is None:
        raise SystemExit(f"no lm_eval executable at {lm_eval!r}: pass --lm-eval PATH")
    return str(Path(found).parent / "python")


def check(options: argparse.Namespace, root: Path) -> int:
    python = lm_eval_python(options.lm_eval, options.lm_eval_python)
    model_dir = root / "tiny"
    build_tiny_causal_lm(model_dir)
    tasks = write_tasks(root)
    served_out, hf_out = root / "out-steadyserve", root / "out-hf"
    models = [
        {"name": MODEL_NAME, "task": "generate", "source": str(model_dir), "dtype": "float32"}
    ]
    server = start_serve(
        free_port(), {"STEADY_MODELS": json.dumps(models)}, root / "steadyserve.log"
    )
    try:
        server.wait_ready(300)
        model_args = (
            f"base_url={server.base_url}/v1/completions,model={MODEL_NAME},num_concurrent=4,"
            f"max_length={MAX_LENGTH},tokenized_requests=True"
        )
        run_lm_eval(
            options.lm_eval, ["--model", "local-completions", "--model_args", model_args],
            tasks, served_out, root,
        )  # fmt: skip
    finally:
        server.stop(60)
    hf_args = f"pretrained={model_dir},dtype=float32,max_length={MAX_LENGTH},add_bos_token=False"
    run_lm_eval(
        options.lm_eval,
        ["--model", "hf", "--model_args", hf_args, "--device", "cpu", "--batch_size", "1"],
        tasks, hf_out, root,
    )  # fmt: skip

    mc = compare_mc(samples(served_out, "ss_mc"), samples(hf_out, "ss_mc"))
    mc_count, mc_worst, mc_flags = mc
    gen_count, gen_differing = compare_gen(samples(served_out, "ss_gen"), samples(hf_out, "ss_gen"))
    rolling = samples(served_out, "ss_rolling")
    roll_count, roll_worst, windows = compare_rolling(rolling, python, model_dir, root)
    rows = [
        ("ss_mc", f"{mc_count} loglikelihoods", f"{mc_worst:.2e}", f"{mc_flags} greedy flags"),
        ("ss_gen", f"{gen_count} texts", "-", f"{gen_differing} texts"),
        ("ss_rolling", f"{roll_count} docs, {windows} windows", f"{roll_worst:.2e}", "-"),
    ]
    print("against: ss_mc, ss_gen: lm-eval's hf backend; ss_rolling: a forward over the API's")
    print("windows (511 tokens). Tolerance for loglikelihoods: " + f"{LL_TOLERANCE:g}")
    header = ("task", "samples", "worst difference", "differing")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]
    for row in [header, tuple("-" * width for width in widths), *rows]:
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |")
    ok = (
        max(mc_worst, roll_worst) <= LL_TOLERANCE
        and mc_flags == 0
        and gen_differing == 0
        and min(mc_count, gen_count, roll_count) > 0
    )
    print("verdict: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval", default="lm_eval", help="the lm_eval executable")
    parser.add_argument(
        "--lm-eval-python",
        help="a python with torch, transformers and lm_eval (default: beside --lm-eval)",
    )
    parser.add_argument(
        "--keep", type=Path, help="work in this (new) folder and keep it, instead of a temp dir"
    )
    options = parser.parse_args(argv)
    if options.keep is not None:
        options.keep.mkdir(parents=True)
        return check(options, options.keep.resolve())
    with tempfile.TemporaryDirectory(prefix="lm-eval-check-") as root:
        return check(options, Path(root))


if __name__ == "__main__":
    sys.exit(main())
