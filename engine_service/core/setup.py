"""From engine flags to the core's parts: admission limits and the checkpoint manager."""

from __future__ import annotations

import grpc
import mlx.core as mx

from engine_service.checkpoints.manager import CheckpointManager, CheckpointSettings
from engine_service.config import EngineConfig
from engine_service.loop.limits import Limits
from engine_service.loop.preemption import ParkSettings
from engine_service.model.loaded import LoadedModel
from tandem_client.credentials import bearer_token, tls_credentials


def scheduler_limits(config: EngineConfig) -> Limits:
    return Limits(
        config.max_running,
        config.max_queued,
        config.prefill_batch_size,
        config.prefill_step_size,
        config.admission_window_s,
        ParkSettings(
            config.park_after_tokens,
            config.park_bytes,
            config.park_idle_timeout_s,
            config.turn_tokens,
        ),
        config.kv_codec,
    )


def store_settings(config: EngineConfig) -> tuple[grpc.ChannelCredentials | None, str]:
    """TLS credentials and token for the engine's store client (files read once, here)."""
    tls = config.store_tls_ca or config.store_tls_cert
    try:
        credentials = (
            tls_credentials(config.store_tls_ca, config.store_tls_cert, config.store_tls_key)
            if tls
            else None
        )
        token = bearer_token(config.store_token_file) if config.store_token_file else ""
    except (OSError, ValueError) as exc:
        raise OSError(f"store credentials: {exc}") from None
    return credentials, token


def checkpoint_manager(
    config: EngineConfig, loaded: LoadedModel, deterministic: str = ""
) -> CheckpointManager:
    """deterministic: the mode's arithmetic (model/deterministic.arithmetic), "" when off."""
    credentials, token = store_settings(config)
    return CheckpointManager(
        loaded,
        CheckpointSettings(
            store=config.store,
            local_cache_bytes=config.prefix_cache_bytes,
            spill_queue_bytes=config.spill_queue_bytes,
            store_credentials=credentials,
            store_token=token,
            store_region_bytes=config.store_region_bytes,
            direct_reads=config.store_direct_reads == "on"
            or (config.store_direct_reads == "auto" and mx.cuda.is_available()),
            spill_batch_records=config.spill_batch_records,
            prefill_step_size=config.prefill_step_size,
            deterministic=deterministic,
        ),
    )
