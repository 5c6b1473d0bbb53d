"""The one place configuration comes from.

`Settings()` reads the environment (prefix ``STEADY_``) when it is constructed, and only
then: nothing in steadyserve reads the environment at import time. The CLI builds one
`Settings` and hands it to `create_app`; everything else receives the values it needs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from app.model_specs import ModelSpec, ModelSpecs
from app.settings_generation import GenerationSettings
from app.settings_rules import default_frontend_processes, inconsistency, valid_networks

Device = Literal["auto", "cpu", "cuda"]
EngineMode = Literal["process", "inprocess"]


class Settings(GenerationSettings):
    """Every setting, with its default and what it means (`settings_doc.py` builds the
    README's table from this); the generation task's are `GenerationSettings`'."""

    model_config = SettingsConfigDict(env_prefix="STEADY_", extra="ignore", frozen=True)

    # --- serving -----------------------------------------------------------------------
    host: str = Field(default="127.0.0.1", description="Address uvicorn binds.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port uvicorn binds.")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        default="info",
        description="Logging level (any case). Others are refused: uvicorn takes no `warn`, "
        "and a front end that cannot start its server would restart forever.",
    )
    keep_alive_timeout_s: float = Field(
        default=75.0,
        ge=1,  # uvicorn takes whole seconds: under 1 would close every idle connection at once
        description="Idle keep-alive connections are closed after this; keep it above the "
        "proxy's upstream idle timeout so the proxy, not the server, closes idle connections.",
    )
    models: ModelSpecs = Field(
        default=(ModelSpec(),),
        description='Models to serve, as JSON: `[{"name":..., "task":"embed", "source":...}]`; '
        "a `tensor` model also declares its `inputs` and `outputs` (README: Open Inference "
        "Protocol).",
    )
    default_model: str | None = Field(
        default=None, description="Model used when a request names none; the first model if unset."
    )
    device: Device = Field(
        default="auto", description="`cuda` if available when `auto`, else `cpu`."
    )

    # --- processes ---------------------------------------------------------------------
    engine: EngineMode = Field(
        default="process",
        description="`process`: the model runs in its own supervised engine process fed by "
        "the front ends; `inprocess`: one process does everything (tests, debugging).",
    )
    frontend_workers: int | None = Field(
        default=None,
        ge=1,
        description="Front-end processes sharing the port (SO_REUSEPORT), each parsing, "
        "tokenizing and answering; defaults to half the CPUs (at least 1, at most 8). "
        "Always 1 with `engine=inprocess`.",
    )
    health_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="/healthz, /readyz and /metrics are also answered on this port, which "
        "carries no traffic: in engine-process mode by the supervisor, so no flood delays a "
        "kubelet's probe or a scrape; with STEADY_ENGINE=inprocess by the one process, on its "
        "traffic's loop.",
    )
    frontend_nice: int = Field(
        default=5,
        ge=0,
        le=19,
        description="Niceness added to front-end processes so a flood of connections cannot "
        "take CPU from the engine's admitted work.",
    )
    max_connections: int = Field(
        default=8192,
        ge=1,
        description="Open connections per front-end process; once this many are open, each "
        "request is answered 429 (reason `connections`, Retry-After 1 s) from its headers and "
        "its connection closed, but Prometheus's GET /metrics, served. Sized so a flood meets "
        "the in-flight cap's 429s long before it.",
    )
    listen_backlog: int = Field(
        default=4096,
        ge=1,
        description="Accept queue per front-end socket (bounded by net.core.somaxconn).",
    )
    refused_read_pause_s: float = Field(
        default=1.0,
        ge=0,
        description="After a 429/503 with Retry-After that admissions have not paid for "
        "(`refusals_at_once_per_admission`), the front end reads that connection's next "
        "request no sooner than Retry-After or this, whichever is shorter (0: at once; "
        "a trusted proxy's connections, which carry other clients' requests, are never "
        "paused: `trusted_proxies`). A client that honours Retry-After never notices; one "
        "that resends at once can no longer make refusals crowd out admitted work.",
    )
    refusals_at_once_per_admission: float = Field(
        default=5.0,
        ge=0,
        description="Refused requests answered without pausing their connection, earned per "
        "admitted request (a few dozen admissions' worth can be banked). An open loop at "
        "up to 6x capacity is never paused; a closed-loop flood outruns it and is paused "
        "as `refused_read_pause_s` says. 0: every refused connection is paused.",
    )
    trusted_proxies: tuple[str, ...] = Field(
        default=(),
        description="Proxies in front, as a JSON list of addresses or CIDR blocks "
        '(`["10.0.0.0/8"]`): a request whose connection comes from one of them and that '
        "carries a proxy's header (Via, Forwarded, X-Forwarded-*, x-envoy-*) is a proxy's, "
        "and its connection is never paused after a refusal. From any other peer those "
        "headers count for nothing: a client could send them to dodge the pause. Empty: no "
        "peer is a proxy. The Kubernetes manifests trust the private ranges pod addresses "
        "come from (deploy/README.md).",
    )
    body_read_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="A request body not received in full within this is answered 408 and "
        "its connection closed (a stalled or trickling client holds nothing longer); the "
        "rest of a body whose request was answered first (a refusal) is discarded for at "
        "most this long, then its connection is closed.",
    )
    engine_restart_backoff_s: tuple[float, float] = Field(
        default=(1.0, 30.0),
        description="First and longest wait before restarting an engine (or a front end) "
        "that died; doubles per consecutive death, reset once an engine has been ready (a front "
        "end serving) for a minute.",
    )
    engine_ready_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="An engine process not ready this long after it started (still loading, "
        "which includes downloading a hub model missing from the local cache, or warming up) "
        "is killed by the supervisor and restarted with backoff; five such restarts in a row "
        "turn the probe port's /healthz 503. Longer than the slowest load and warm-up: the "
        "GPU overlay's startup probe allows ten minutes.",
    )
    stuck_compute_s: float = Field(
        default=60.0,
        gt=0,
        description="A ready engine process whose oldest compute (a batch, a generation "
        "dispatch of up to STEADY_GENERATE_STEPS_PER_DISPATCH steps) "
        "has run this long is killed by the supervisor and restarted with backoff: a wedged "
        "GPU or a driver call that never returns leaves its event loop publishing a live "
        "status while nothing is answered. Far above the slowest batch or step, and at least "
        "STEADY_MAX_TIMEOUT_MS: a compute no request can wait for any more is stuck.",
    )
    unhealthy_after_failed_batches: int = Field(
        default=5,
        ge=1,
        description="Consecutive failed batches of any one model after which /healthz "
        "answers 503 (so Kubernetes restarts the pod), naming the model; a successful batch "
        "of that model clears its count (another model's does not).",
    )

    # --- batching ----------------------------------------------------------------------
    length_buckets: tuple[int, ...] = Field(
        default=(16, 32, 64, 128, 256, 512),
        min_length=1,
        description="Padded token lengths; each input is padded up to the smallest bucket "
        "that holds it. An embedding model's stop at its longest input, the last cut to it "
        "(never past its positions).",
    )
    max_batch_size: int = Field(
        default=32,
        ge=1,
        le=1024,  # the batch-size histogram's largest bucket (`metrics.BATCH_SIZE_BUCKETS`)
        description="Largest batch; batch buckets are 1, 2, 4, ... up to this.",
    )
    max_batch_tokens: int = Field(
        default=4096,
        ge=1,
        description="Cap on (batch size x length bucket); long buckets get smaller batches.",
    )
    max_wait_ms: float = Field(
        default=2.0,
        ge=0,
        description="Longest a request waits for its batch to fill once a worker is free.",
    )

    # --- admission ---------------------------------------------------------------------
    rate_limit_per_s: float = Field(
        default=100_000.0,
        gt=0,
        description="Token-bucket refill rate, in model tokens per second, shared equally by "
        "the front-end processes.",
    )
    rate_limit_burst: int = Field(
        default=32_768,
        ge=1,
        description="Token-bucket capacity, in model tokens (the largest burst admitted at "
        "once); must hold the largest request, and one full KV-cache slot.",
    )
    max_queue_delay_ms: float = Field(
        default=100.0,
        gt=0,
        description="Admit a request only while its model's predicted wait (running batches' "
        "rest, its model's full batches queued ahead and its own, a batch of each other busy "
        "model before each) fits this and its deadline; else 429, Retry-After. For a 150 ms p99.",
    )
    max_admission_wait_ms: float = Field(
        default=50.0,
        ge=0,
        description="Longest a request waits for a token before a 429 (reason `rate`).",
    )
    max_inflight: int = Field(
        default=512,
        ge=1,
        description="Inference requests a front end holds, from their headers to their "
        "answer; beyond it, 429 (reason `inflight`) before the body is read. A request "
        "whose body has not arrived 0.25 s after its headers holds no place until it does "
        "(then 429 if none is free): slow or absent bodies cannot fill the cap.",
    )
    max_body_reads: int = Field(
        default=2048,
        ge=1,
        description="Inference requests a front end holds whose body is still arriving; "
        "beyond it, 429 (reason `inflight`) before the body is read. Bounds the memory of "
        "partly read bodies (at most this x max_body_bytes); filling it takes as many "
        "connections, each cut after body_read_timeout_s.",
    )
    max_queue: int = Field(
        default=4096,
        ge=1,
        description="Backstop on each model's inputs waiting for a batch in the engine; "
        "beyond it, 429 (reason `queue`). The delay budget normally refuses long before.",
    )
    max_inputs_per_request: int = Field(
        default=64, ge=1, description="Inputs (generation: prompts x n) in a request; over, 413."
    )
    max_body_bytes: int = Field(
        default=1_048_576, ge=1024, description="Largest request body; beyond it, 413."
    )
    default_timeout_ms: float = Field(
        default=10_000.0,
        gt=0,
        description="Deadline of a request that sets neither `timeout_ms` nor Envoy's header; "
        "at most STEADY_MAX_TIMEOUT_MS.",
    )
    max_timeout_ms: float = Field(
        default=60_000.0, gt=0, description="Upper bound on any request's deadline."
    )

    # --- dispatcher and buffers --------------------------------------------------------
    dispatcher_threads: int | None = Field(
        default=None,
        ge=1,
        description="Threads that run the model (batches in flight at once); defaults to 2, "
        "or 1 when the engine has a single CPU (the quota less one per front-end process).",
    )
    torch_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch intra-op threads per dispatcher thread; defaults to the cgroup CPU "
        "quota less one CPU per front-end process, divided among the dispatcher threads.",
    )
    torch_interop_threads: int | None = Field(
        default=None, ge=1, description="torch inter-op threads; defaults to 1."
    )
    tokenizer_threads: int = Field(default=1, ge=1, description="Threads that tokenize requests.")
    pool_slots_per_shape: int | None = Field(
        default=None,
        ge=1,
        description="Preallocated buffer slots per (length, batch) shape; defaults to "
        "dispatcher_threads.",
    )

    # --- start-up and shutdown ---------------------------------------------------------
    warmup: bool = Field(
        default=True,
        description="Run every shape serving meets before ready: each (length bucket x batch "
        "bucket) of an embedding or tensor model; a generate model's prefills and decode "
        "steps (every batch size on CPU).",
    )
    cuda_alloc_conf: str = Field(
        default="expandable_segments:True",
        description="Default for PYTORCH_CUDA_ALLOC_CONF when the environment sets none.",
    )
    drain_timeout_s: float = Field(
        default=60.0,
        ge=0,
        description="On SIGTERM, how long admitted requests get to finish (at least the "
        "longest deadline a request may have, STEADY_MAX_TIMEOUT_MS: a generation admitted just "
        "before the signal is not cut); the server exits as soon as nothing is in flight.",
    )
    drain_quiet_s: float = Field(
        default=1.0,
        ge=0,
        description="On SIGTERM, exit once nothing is in flight and no inference request has "
        "arrived (and been answered 503) for this long, so clients and proxies see the 503s "
        "and move on before the socket closes; bounded by drain_timeout_s.",
    )

    # --- slow-request reports (docs/SPIKES.md) ------------------------------------------
    spike_reports: bool = Field(
        default=True,
        description="Sample the probes (event loop, GC, CPU, cgroup, CUDA, GPU) and keep a "
        "report, with its causes, of every slow request (GET /debug/slow).",
    )
    slow_request_ms: float = Field(
        default=150.0,
        gt=0,
        description="An inference request slower than this (ms, arrival to the last byte "
        "of its answer) is reported; with slow_request_p99_multiple, the floor of that rule.",
    )
    slow_request_p99_multiple: float | None = Field(
        default=None,
        gt=1,
        description="When set, a request is slow past this multiple of the running p99 of "
        "this front end's last 1000 requests (and past slow_request_ms).",
    )
    slow_request_reports: int = Field(
        default=256,
        ge=1,
        description="Reports each front end keeps for GET /debug/slow (the newest ones).",
    )

    # --- debug -------------------------------------------------------------------------
    debug_token: str | None = Field(
        default=None,
        min_length=1,  # an empty token would let a request without credentials match it
        description="Enables /debug/* when set; requests must send "
        "`Authorization: Bearer <token>`.",
    )

    @field_validator("trusted_proxies")
    @classmethod
    def _valid_networks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return valid_networks(value)

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_case_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_consistency(self) -> Settings:
        problem = inconsistency(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    @property
    def default_model_name(self) -> str:
        return self.default_model or self.models[0].name

    def frontend_processes(self, cpus: int) -> int:
        if self.engine == "inprocess":
            return 1
        return self.frontend_workers or default_frontend_processes(cpus)
