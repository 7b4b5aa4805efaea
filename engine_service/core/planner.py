"""Where a request starts: its own generation checkpoint (resume), a cached prefix, or nothing.

Runs on the core's planning pool before the request is submitted: it may call the store (lookup,
get), which the MLX thread never does. The MLX thread later materializes the plan
(checkpoints.starting_point).
"""

from __future__ import annotations

from collections.abc import Callable

from engine_service.checkpoints.attachments import DRAFT_SCHEMA
from engine_service.checkpoints.logprob_pages import LogprobLog, read_pages, replay_entries
from engine_service.checkpoints.manager import CheckpointManager
from engine_service.checkpoints.prefix_cache import BLOCK_SIZE
from engine_service.core.plans import Plan, ResumePlan
from engine_service.errors import GenerationEnded, InvalidRequest
from engine_service.protocol.requests import DraftSupport, GenerationRequest

# How long a prefix lookup waits for the prefixes whose first token is out to be kept: at
# most the rest of one step, which a new request waits anyway to join the batch.
SAVES_WAIT_S = 2.0


class Planner:
    def __init__(
        self,
        checkpoints: CheckpointManager | None,
        drafts: DraftSupport,
        saves_settled: Callable[[float], bool] = lambda timeout: True,
    ) -> None:
        self.checkpoints = checkpoints
        self.drafts = drafts
        # The scheduler's queued_saves: a prompt's prefix is kept just after its first token
        # leaves (loop/step_checkpoints.py), so a request for the same prompt that arrives in
        # between (the gateway's other choices of `n`, a retry) waits for it, not prefills.
        self.saves_settled = saves_settled

    def needed(self, req: GenerationRequest) -> bool:
        """Whether planning may find anything (else it is skipped: no thread hop)."""
        return self.checkpoints is not None and (req.resume or len(req.prompt) > BLOCK_SIZE)

    def plan(self, req: GenerationRequest) -> Plan:
        """The checkpoint a request starts from (blocking: call off the event loop).

        Raises NotFound / Precondition / Corrupt for a resume that cannot go on.
        """
        ckpt = self.checkpoints
        if ckpt is None:
            return None
        if req.resume:
            gens = ckpt.generations
            key = gens.key(req.namespace, req.prompt, req.sampling, req.request_id, req.layout)
            # A speculative generation resumes with its draft model's cache when the
            # checkpoint carries one made by this engine's draft model.
            companions = (
                {DRAFT_SCHEMA: {"draft_model": self.drafts.model_id}} if req.num_draft else None
            )
            try:
                plan = gens.loads.load(key, req.namespace, req.prompt, req.layout, companions)
            except GenerationEnded as ended:
                # A claim of more tokens than the generation ever emitted is the request's
                # error, whether it ended before this resume or ends during it
                # (front/response_stream.py says the same then).
                if ended.generated is not None and req.tokens_held > ended.generated:
                    raise InvalidRequest(
                        f"tokens_held {req.tokens_held} exceeds the {ended.generated} tokens "
                        "this generation emits; resume with the count of tokens received"
                    ) from ended
                # Finished while its client was losing the last tokens (a gateway killed
                # mid-stream, its buffer with it): they are replayed from the tombstone,
                # with the end, and nothing is computed. A generation that ended otherwise
                # (cancelled, failed, a stop string) has no tail to give.
                tokens = ended.tokens
                if not (ended.finished and tokens and req.finished_by(tokens)):
                    raise
                plan = ResumePlan(key, tokens[:-1], tokens[-1], req.layout, parts=[])
            return self._with_logprobs(req, plan)
        if len(req.prompt) > BLOCK_SIZE:
            self.saves_settled(SAVES_WAIT_S)
            return ckpt.prefixes.find(req.prompt, req.namespace, req.layout, req.prefix_record)
        return None

    def _with_logprobs(self, req: GenerationRequest, plan: ResumePlan) -> ResumePlan:
        """A resume that asked for logprobs: those of the replayed tokens its client does not
        hold, and (when it goes on checkpointing) its log of pages to go on writing and
        leasing, read from the pages beside the checkpoint (checkpoints/logprob_pages.py).
        Precondition, the plan released, when the store does not hold the ones to send."""
        assert self.checkpoints is not None
        store = self.checkpoints.generations.store
        if req.sampling.logprobs < 0 or store is None:
            return plan
        replay = plan.replay
        held = min(req.tokens_held, len(replay))
        # A run that goes on checkpointing reads every page: it leases them again.
        first = 0 if req.checkpoint_interval else held
        try:
            read = read_pages(store, plan.key, req.namespace, replay, first)
            plan.replay_logprobs = replay_entries(read.entries, replay, held, req.sampling.logprobs)
        except BaseException:
            plan.release()
            raise
        if req.checkpoint_interval:
            plan.logprob_log = LogprobLog.resumed(read, len(replay))
        return plan
