"""Admission of one generate model's requests, by time: a request is let in while its
sequence's predicted start (the compute slots' turns and a KV-cache slot's, as published)
and its steps, priced with the other models' turns between them (`kv_slots.step_price`),
fit its deadline and the delay budget; the tokens a request that set no limit may generate
are then fitted to its deadline on the wait it was admitted on. Event loop thread only.
"""

from __future__ import annotations

from app.admission import RETRY_AFTER_UNKNOWN_S, Rejected, RejectReason
from app.engine import kv_slots
from app.engine.generation_batch import SequenceTable
from app.engine.host import EngineLoad
from app.engine.protocol import GeneratePayload, SamplingParams, Submit
from app.model_queues import naming
from app.models.causal_lm import CausalLMRunner
from app.settings_generation import GenerationSettings


class GenerationAdmission:
    def __init__(
        self,
        runner: CausalLMRunner,
        batch: SequenceTable,
        settings: GenerationSettings,
    ) -> None:
        self.name = runner.name
        self._runner = runner
        self._batch = batch
        self._max_waiting = settings.generate_max_waiting
        self._chunk_tokens = settings.generate_prefill_chunk_tokens
        # What `admit` let in last, its wait and its steps' price, for `fitted` (next).
        self._admitted: tuple[Submit, float, kv_slots.StepPrice] | None = None

    def admit(self, request: Submit, load: EngineLoad, step_s: float) -> Rejected | None:
        """Refused (429, or 504 past its deadline) or None: let in, or a bad request that
        `GenerationHost.submit` refuses (400). `step_s`: the smoothed seconds a step."""
        payload = request.payload
        if not isinstance(payload, GeneratePayload):
            return None  # refused as a bad request by `submit`
        if kv_slots.payload_problem(payload, self._runner) is not None:
            return None  # likewise
        if self._batch.at_cap(self._max_waiting):  # as its published queue says (`work`)
            return Rejected(
                RejectReason.QUEUE,
                f"model {self.name!r}: {len(self._batch.waiting)} sequences wait for a "
                f"KV-cache slot (cap generate_max_waiting={self._max_waiting})",
                # 0 until a step is measured (no warm-up): unknown, yet a 429 says when.
                load.backlog_s or RETRY_AFTER_UNKNOWN_S,
            )
        sampling = payload.sampling
        # Without a client-set limit it needs time for one token: `fitted` fits the rest;
        # a prompt over a chunk takes a step more per chunk before its first token.
        planned = 1 if sampling.fit_to_deadline else sampling.max_new_tokens
        chunks = kv_slots.prefill_steps(len(payload.prompt_ids), self._chunk_tokens)
        price = kv_slots.step_price(self.name, load.works, load.workers, step_s)
        verdict = kv_slots.start_verdict(
            wait_s=load.backlog_s,  # compute slots' turns, a KV-cache slot's: as published
            generate_s=price.seconds(planned, chunks),  # the other models' turns between steps
            deadline=request.deadline,
            now=load.now,
            max_queue_delay_s=load.max_queue_delay_s,
        )
        if verdict is None:
            self._admitted = (request, load.backlog_s, price)
        return naming(self.name, verdict)

    def fitted(
        self,
        request: Submit,
        payload: GeneratePayload,
        time_left: float,
        slot_wait_s: float,
        step_s: float,
    ) -> SamplingParams:
        """The sampling `request` runs with: a limit it did not set fitted to `time_left`,
        planned against the wait it was admitted on, the other models' turns included (a
        KV-cache slot's alone, `slot_wait_s`, let a flood elsewhere run it to its
        deadline, cut short); a request `admit` did not see last is planned on
        `slot_wait_s` and `step_s` alone."""
        admitted, self._admitted = self._admitted, None
        if admitted is not None and admitted[0] is request:
            _, wait_s, price = admitted
        else:
            wait_s, price = slot_wait_s, kv_slots.StepPrice(step_s)
        # Its prompt's chunks before its tokens, one price (as `admit`'s).
        chunks = kv_slots.prefill_steps(len(payload.prompt_ids), self._chunk_tokens)
        return kv_slots.fitted_sampling(payload.sampling, time_left, wait_s, price, chunks)
