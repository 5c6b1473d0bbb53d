"""The rules between settings that no single field's bounds express (a setting may be valid
alone and the whole still unservable). Pure; `Settings` applies them when it is built."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.settings import Settings


def default_frontend_processes(cpus: int) -> int:
    """Front ends when `frontend_workers` is unset: half the CPUs, at least 1, at most 8."""
    return max(1, min(8, cpus // 2))


def valid_networks(value: tuple[str, ...]) -> tuple[str, ...]:
    """`trusted_proxies` as networks. A typo must stop the server (not trust nobody, in
    silence); `10.0.0.1/8`, with host bits set, is refused rather than guessed at."""
    return tuple(str(ipaddress.ip_network(address.strip())) for address in value)


def inconsistency(settings: Settings) -> str | None:
    """The first rule `settings` break, as the error to show; None when they hold."""
    buckets = settings.length_buckets
    if list(buckets) != sorted(set(buckets)) or buckets[0] < 2:
        return "length_buckets must be strictly increasing and >= 2"
    if settings.max_inputs_per_request * buckets[-1] > settings.rate_limit_burst:
        return (
            "rate_limit_burst must hold the largest request "
            "(max_inputs_per_request x the largest length bucket, in tokens)"
        )
    if settings.max_inputs_per_request > settings.max_queue:
        return "max_inputs_per_request must not exceed max_queue"
    names = [m.name for m in settings.models]
    if len(set(names)) != len(names):
        return "model names must be unique"
    if settings.default_model is not None and settings.default_model not in names:
        return f"default_model {settings.default_model!r} is not among {names}"
    if settings.max_batch_tokens < buckets[-1]:
        return (
            "max_batch_tokens must hold one input of the largest length bucket "
            "(a batch of one such input would exceed it)"
        )
    first, longest = settings.engine_restart_backoff_s
    if not 0 < first <= longest:
        return (
            "engine_restart_backoff_s must be (first, longest) with 0 < first <= longest: "
            "a zero wait restarts a crashing process in a tight loop"
        )
    if settings.stuck_compute_s < settings.max_timeout_ms / 1000:
        return (
            "stuck_compute_s must be at least max_timeout_ms (in seconds): a compute that "
            "some request may still wait for is not stuck, and killing its engine fails "
            "every request in it"
        )
    if settings.drain_timeout_s < settings.max_timeout_ms / 1000:
        return (
            "drain_timeout_s must be at least max_timeout_ms (in seconds): a request admitted "
            "just before SIGTERM may wait that long, and a shorter drain cuts it"
        )
    if settings.default_timeout_ms > settings.max_timeout_ms:
        return (
            "default_timeout_ms must not exceed max_timeout_ms: every deadline is cut to "
            "max_timeout_ms, so such a default is not the deadline requests get"
        )
    if settings.health_port is not None and settings.health_port == settings.port:
        return "health_port must differ from port (it carries no traffic)"
    for model in settings.models:
        smallest = sum(tensor.smallest_row_bytes() for tensor in model.inputs)
        if smallest > settings.max_body_bytes:
            return (
                f"max_body_bytes ({settings.max_body_bytes}) is under the smallest request to "
                f"tensor model {model.name!r} ({smallest} bytes: one row, dynamic dimensions "
                "at 1, each element its raw bytes or one JSON digit and comma): every request "
                "to it would be refused 413"
            )
    generates = any(model.task == "generate" for model in settings.models)
    if generates and settings.generate_slot_tokens > settings.rate_limit_burst:
        return (
            "rate_limit_burst must hold one full KV-cache slot (generate_slot_tokens): a "
            "generation is charged its prompt + max_new_tokens, all a slot's room when "
            "max_tokens is left out, and a charge over the burst is refused (413)"
        )
    chunk = min(settings.generate_prefill_chunk_tokens, settings.generate_slot_tokens)
    if settings.generate_max_batch_tokens < chunk:
        return (
            "generate_max_batch_tokens must hold one prefill chunk (the smaller of "
            "generate_prefill_chunk_tokens and generate_slot_tokens), so every admitted "
            "prompt can be prefilled"
        )
    return None
