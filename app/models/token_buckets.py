"""The row counts a generation step's linears run on, so warm-up can have run each of them.

On a CPU, torch's bf16 matrix products go through oneDNN, which builds a
primitive for each new input shape: the first linear of a new row count M costs 200-1100 us
instead of 20-50 (the tiny model's five weight shapes: ~3-4 ms of set-up a step). A step's
linears run on M = rows x query tokens: a decode step's M is its rows (1..slots, each warmed
up); a prefill step's is rows x its longest chunk, almost any number up to
`generate_max_batch_tokens`. So the direct decoder (`direct_decoder.py`) pads an M over the
slot count up to a bucket (`padded_tokens`), warm-up runs a prefill at each bucket
(`bucket_prefills`), and no step's linears meet a shape warm-up did not build.

The buckets are the powers of two and 1.5 x powers of two (2 a doubling): a padded step
computes at most 1.5x the linears' rows (1.33x from 1.5 x 2^k), ~1.2x on average, and
warm-up runs ~2 prefills a doubling of M. On CUDA nothing is padded: its kernels are chosen,
not built, per shape. Arithmetic only (torch for the device type).
"""

from __future__ import annotations

import torch


def pads_tokens(device: torch.device) -> bool:
    """Whether a step's linears run on bucketed row counts on `device`: on a CPU (oneDNN
    builds a primitive per shape), not on CUDA."""
    return device.type == "cpu"


def padded_tokens(tokens: int, exact: int) -> int:
    """The row count the linears run on for `tokens` flattened tokens: `tokens` itself up
    to `exact` (the decode sizes warm-up runs), else the smallest 2^k or 3 x 2^(k-1) that
    holds it."""
    if tokens <= exact:
        return tokens
    power = 1 << (tokens - 1).bit_length()  # the smallest power of two >= tokens
    three_halves = power // 4 * 3  # 1.5 x the power of two below
    return three_halves if tokens <= three_halves and power >= 4 else power


def bucket_prefills(
    exact: int, slots: int, row_tokens: int, step_tokens: int
) -> list[tuple[int, int]]:
    """One prefill (rows, tokens a row) for each bucket a step pads to: every bucket over
    `exact` that a step of at most `slots` rows of at most `row_tokens` tokens, rows x
    longest at most `step_tokens`, reaches; each of the fewest rows that reach it."""
    shapes: list[tuple[int, int]] = []
    below = exact
    while below < step_tokens:
        bucket = padded_tokens(below + 1, exact)
        shape = _prefill_rows(bucket, below, slots, row_tokens, step_tokens)
        if shape is not None:
            shapes.append(shape)
        below = bucket
    return shapes


def _prefill_rows(
    bucket: int, below: int, slots: int, row_tokens: int, step_tokens: int
) -> tuple[int, int] | None:
    """(rows, tokens a row) whose product is over `below` and at most `bucket` and
    `step_tokens`, the fewest rows; None if no step of at most `slots` rows of at most
    `row_tokens` tokens has one."""
    most = min(bucket, step_tokens)
    for rows in range(1, slots + 1):
        length = min(row_tokens, most // rows)
        if length >= 1 and rows * length > below:
            return rows, length
    return None
