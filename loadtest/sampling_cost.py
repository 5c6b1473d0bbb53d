"""CPU cost of the next-token choice for sampled rows (`app/models/sampling.py`), per row
and step, on a large vocabulary: `python -m loadtest.sampling_cost [--baseline FILE]`.

Logits are synthetic: `confident` (one token holds ~99.9 % of the mass, the most common
decoding step), `peaked` (normal, scale 4: top-p 0.95 keeps tens of tokens) and `flat`
(scale 0.5: top-p keeps most of the vocabulary, the worst case). `--baseline` times another
version of the module (a copy of an older `sampling.py`) back to back in the same run, for
a ratio. One torch thread.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from types import ModuleType

import torch

from app.engine.protocol import SamplingParams
from app.models import sampling

CASES = {
    "temperature 0.8, top_p 0.95": SamplingParams(1, do_sample=True, temperature=0.8, top_p=0.95),
    "temperature 0.8, top_k 50": SamplingParams(1, do_sample=True, temperature=0.8, top_k=50),
    "temperature 0.8": SamplingParams(1, do_sample=True, temperature=0.8),
}


def per_row_ms(module: ModuleType, logits: torch.Tensor, params: SamplingParams) -> float:
    rows = len(logits)
    generators = [torch.Generator().manual_seed(row) for row in range(rows)]
    module.choose_tokens(logits, [params] * rows, generators)  # warm
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        module.choose_tokens(logits, [params] * rows, generators)
        best = min(best, time.perf_counter() - started)
    return best / rows * 1000


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_sampling", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another sampling.py to time beside this one")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32_000, 151_936])
    parser.add_argument("--rows", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    baseline = load(args.baseline) if args.baseline else None
    print("| vocab | logits | params | ms/row | baseline ms/row | ratio |")
    print("|---:|---|---|---:|---:|---:|")
    for vocab in args.vocab:
        for shape, scale in (("confident", 1.0), ("peaked", 4.0), ("flat", 0.5)):
            logits = torch.randn(args.rows, vocab, generator=torch.Generator().manual_seed(0))
            logits *= scale
            if shape == "confident":
                logits[:, 0] = logits.max() + 12
            for name, params in CASES.items():
                ours = per_row_ms(sampling, logits, params)
                if baseline is None:
                    print(f"| {vocab} | {shape} | {name} | {ours:.3f} | - | - |")
                    continue
                theirs = per_row_ms(baseline, logits, params)
                ratio = theirs / ours
                print(f"| {vocab} | {shape} | {name} | {ours:.3f} | {theirs:.3f} | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
