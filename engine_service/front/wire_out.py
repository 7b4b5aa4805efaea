"""The engine's domain types out as protobuf messages: streamed responses, model info, stats
and flush results (front/wire.py takes requests in)."""

from __future__ import annotations

from engine_service import blas
from engine_service.front.policy import RequestPolicy
from engine_service.front.response_stream import ResponseChunk
from engine_service.front.wire import SCHEMES_PB
from engine_service.protocol.checkpoint_stats import CheckpointStats
from engine_service.protocol.engine_stats import EngineStats
from engine_service.protocol.flush import FlushResult
from engine_service.protocol.kv_codec import request_layout
from tandem_wire.pb import engine_pb2

SCHEME_TO_PB = {v: k for k, v in SCHEMES_PB.items()}

_FINISH = {
    "length": engine_pb2.FINISH_REASON_LENGTH,
    "stop": engine_pb2.FINISH_REASON_STOP,
    "cancelled": engine_pb2.FINISH_REASON_CANCELLED,
    "error": engine_pb2.FINISH_REASON_ERROR,
}


def response_to_pb(chunk: ResponseChunk) -> engine_pb2.GenerateResponse:
    message = engine_pb2.GenerateResponse(
        token_ids=chunk.token_ids,
        text=chunk.text,
        reasoning_text=chunk.reasoning_text,
        logprobs=[
            engine_pb2.TokenLogprob(
                token_id=lp.token_id,
                logprob=lp.logprob,
                text=lp.text,
                top=[
                    engine_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob, text=t.text)
                    for t in lp.top
                ],
            )
            for lp in chunk.logprobs
        ],
        matched_stop=chunk.matched_stop,
        error=chunk.error,
        request_id=chunk.request_id,
        tool_calls=[
            engine_pb2.ToolCallDelta(index=c.index, id=c.id, name=c.name, arguments=c.arguments)
            for c in chunk.tool_calls
        ],
    )
    if chunk.finish_reason is not None:
        message.finish_reason = _FINISH[chunk.finish_reason]
    if chunk.usage is not None:
        u = chunk.usage
        message.usage.CopyFrom(
            engine_pb2.Usage(
                prompt_tokens=u.prompt_tokens,
                cached_prompt_tokens=u.cached_prompt_tokens,
                generated_tokens=u.generated_tokens,
                ttft_seconds=u.ttft_seconds,
                decode_tokens_per_second=u.decode_tokens_per_second,
                draft_tokens=u.draft_tokens,
                accepted_draft_tokens=u.accepted_draft_tokens,
                constraint_incomplete=u.constraint_incomplete,
                prefix_miss_reason=u.prefix_miss_reason,
                prefix_source=u.prefix_source,
            )
        )
    return message


def model_info_to_pb(policy: RequestPolicy) -> engine_pb2.ModelInfoResponse:
    m, kv = policy.loaded, policy.default_kv
    return engine_pb2.ModelInfoResponse(
        model_id=m.model_id,
        name=m.name,
        digest=m.digest,
        context_length=policy.context,
        vocab_size=m.vocab_size,
        layout=request_layout(m.layout, kv),
        kv_bits=kv.bits,
        kv_group_size=kv.group_size,
        quantized_kv_start=kv.start,
        kv_scheme=SCHEME_TO_PB[kv.scheme] if kv.quantized else engine_pb2.KV_SCHEME_UNSPECIFIED,
        kv_value_bits=kv.value_bits,
        draft_model_id=policy.drafts.model_id,
        num_draft_tokens=policy.drafts.default,
        model_type=str(m.config.get("model_type", "")),
        dtype=m.dtype,
        eos_token_ids=m.eos_token_ids,
        blas=blas.in_use(),
        has_store=policy.has_store,
        deterministic=policy.deterministic,
    )


def stats_to_pb(
    s: EngineStats, checkpoints: CheckpointStats | None, store_configured: bool
) -> engine_pb2.EngineStatsResponse:
    reply = engine_pb2.EngineStatsResponse(
        running=s.running,
        queued=s.queued,
        requests_total=s.requests_total,
        generated_tokens_total=s.generated_tokens_total,
        prompt_tokens_total=s.prompt_tokens_total,
        decode_tokens_per_second=s.decode_tokens_per_second,
        batch_size=s.batch_size,
        max_batch_size_seen=s.max_batch_size_seen,
        mean_batch_size=s.mean_batch_size,
        cancelled_total=s.cancelled_total,
        rejected_total=s.rejected_total,
        isolated_failures_total=s.isolated_failures_total,
        out_of_memory_steps_total=s.out_of_memory_steps_total,
        row_ceiling=s.row_ceiling,
        steps_total=s.steps_total,
        preempted_total=s.parking.preempted_total,
        unparked_total=s.parking.unparked_total,
        idle_cancelled_total=s.parking.idle_cancelled_total,
        park_over_budget_total=s.parking.over_budget_total,
        parked=s.parking.parked,
        parked_bytes=s.parking.parked_bytes,
        parked_to_store_total=s.parking.parked_to_store_total,
        turns_yielded_total=s.parking.turns_yielded_total,
        park_capture_failed_total=s.parking.capture_failed_total,
        kv_cache_bytes=s.kv_cache_bytes,
        speculative_rounds_total=s.speculative.rounds_total,
        draft_tokens_total=s.speculative.drafted_total,
        accepted_draft_tokens_total=s.speculative.accepted_total,
        speculative_rollbacks_total=s.speculative.rollbacks_total,
    )
    if checkpoints is not None:
        c = checkpoints
        reply.checkpoints.CopyFrom(
            engine_pb2.CheckpointStats(
                prefix_hits_local=c.local_hits,
                prefix_hits_store=c.store_hits,
                prefix_misses=c.misses,
                restore_failures=c.restore_failures,
                restored_bytes=c.restored_bytes,
                restore_seconds=c.restore_seconds,
                prefill_seconds=c.prefill_seconds,
                saved=c.saved,
                saved_bytes=c.saved_bytes,
                dropped=c.dropped,
                failed=c.failed,
                queued_bytes=c.queued_bytes,
                resumes=c.resumes,
                store_up=c.store_up,
                store_configured=store_configured,
                shared_memory_reads=c.shared_memory_reads,
                restore_bytes_per_second=c.restore_bytes_per_second,
                prefill_tokens_per_second=c.prefill_tokens_per_second,
                restore_chosen=c.restore_chosen,
                prefill_chosen=c.prefill_chosen,
                prefix_misses_by_reason=c.misses_by_reason,
                store_reads_by_route=c.reads_by_route,
                capture_seconds=c.capture_seconds,
            )
        )
    return reply


def flush_to_pb(result: FlushResult) -> engine_pb2.EngineFlushResponse:
    return engine_pb2.EngineFlushResponse(
        durable=result.durable,
        flushed=result.flushed,
        missing=result.missing,
        failed=result.failed,
    )
