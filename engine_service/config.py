"""Engine settings: flags, with TANDEM_ENGINE_* environment variables as defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from engine_service.protocol.kv_codec import KVCodec, Scheme, checked_codec
from engine_service.store_flags import add_store_link_args
from tandem_wire.registry import ValkeyTarget
from tandem_wire.server_flags import (
    AuthFlags,
    EnvDefaults,
    LogFlags,
    MetricsFlags,
    TlsFlags,
    add_auth_args,
    add_grace_arg,
    add_listen_arg,
    add_log_args,
    add_metrics_arg,
    add_off_switch,
    add_tls_args,
    add_valkey_args,
    config_fields,
)

SCHEMES = {"affine": Scheme.AFFINE, "turboquant": Scheme.TURBOQUANT}

MAX_DRAFT = 32  # draft tokens per round a request may ask for


@dataclass(frozen=True)
class EngineConfig:
    model: str = ""
    listen: str = "127.0.0.1:50051"
    store: str = ""
    data_dir: Path = Path(".tandem")
    dtype: str = "auto"
    # Admission: rows decoding at once (the BatchGenerator's batch), and requests waiting.
    max_running: int = 32
    max_queued: int = 256
    # 0 = the model's context length.
    max_context: int = 0
    prefill_step_size: int = 2048
    prefill_batch_size: int = 8
    default_max_tokens: int = 256
    grace_s: float = 10.0
    switch_interval_s: float = 0.001
    # How long the loop waits for the rest of a burst of arrivals before a prefill.
    admission_window_s: float = 0.002
    # Slow readers (loop/preemption.py): unread tokens before a row gives its slot up (0: never),
    # the bytes parked rows may hold, and how long one may stay parked.
    park_after_tokens: int = 256
    park_bytes: int = 1 << 30
    park_idle_timeout_s: float = 300.0
    # Turns (loop/turns.py): tokens a row generates in its slot before it gives the slot up to a
    # waiting request when the batch is full (0: never). Bounds what a stream nobody reads
    # takes before its client's window (megabytes) fills.
    turn_tokens: int = 512
    # Structured output: how long the front waits for a constraint to compile (on a pool of
    # its own, never the batch loop) before refusing it as too complex.
    constraint_compile_timeout_s: float = 10.0
    # Checkpoints: every N generated tokens by default (0 = only when a request asks),
    # the in-memory prefix LRU and the spill queue's byte bounds.
    checkpoint_interval: int = 0
    prefix_cache_bytes: int = 512 << 20
    spill_queue_bytes: int = 1 << 30
    # PEM files; both given = listen with TLS; a client CA = client certificates required.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # Security (docs/security.md): principals, and the explicit opt-out that allows a
    # non-loopback address without authentication.
    auth_file: str = ""
    insecure_no_auth: bool = False
    # How the engine reaches a store that wants TLS (a CA, a client certificate) or a token.
    store_tls_ca: str = ""
    store_tls_cert: str = ""
    store_tls_key: str = ""
    store_token_file: str = ""
    # Same-host data plane (docs/store.md): bytes of shared memory for restores; 0 = off.
    store_region_bytes: int = -1  # -1: sized for the backend (checkpoints.region_bytes)
    # Restores read out of the store's data file (engine_service/store_flags.py says when).
    store_direct_reads: str = "auto"
    spill_batch_records: int = 32  # checkpoint Puts sent in one PutMany (1: one Put each)
    # Prometheus /metrics (front/metrics.py) on HOST:PORT; "" = off.
    metrics_listen: str = ""
    # The shared tier as a registry (front/announce.py): a valkey:// URL to announce this
    # engine in, the file holding its password, the address to announce ("": the listen
    # address as bound), and the heartbeat interval (an announcement lives three of them).
    announce: str = ""
    announce_password_file: str = ""
    announce_address: str = ""
    announce_interval_s: float = 2.0
    log_format: str = "text"  # or "json" (tandem_wire/logs.py)
    log_level: str = "info"
    log_prompts: bool = False  # the prompt's token ids in each request line (private data)
    # Run each decode and prefill shape once at start (MLX-CUDA compiles kernels on first use).
    warmup: bool = True
    # The decode step as one compiled MLX graph where the batch allows (loop/compiled_decode.py),
    # for batches of at most this many rows: past that the GPU's step outweighs the Python
    # graph building it saves, and on an H200 the compiled step was slower (performance.md).
    compiled_decode: bool = True
    compiled_decode_max_batch: int = 8
    # Default KV codec of requests that do not choose one (0 bits = plain).
    kv_bits: int = 0
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    kv_scheme: str = "affine"  # or "turboquant" (kv_codec.Scheme)
    kv_value_bits: int = 0  # TurboQuant's value bits (0: kv_bits)
    # Speculative decoding: a draft model (same tokenizer) and the default draft length.
    draft_model: str = ""
    num_draft_tokens: int = 0
    # Batch-invariant rows (model/deterministic.py); rows: the decode matmul block (0: default).
    deterministic: bool = False
    deterministic_rows: int = 0
    # Decode projections: "blocks" (padded row blocks: cuBLAS), "kernel" (MLX-CUDA only:
    # model/invariant_matmul_cuda.py, near a GEMV's speed at a few rows) or "auto" (the
    # kernel where it runs: within 25% of the default mode at 1-128 streams on an H200).
    deterministic_matmul: str = "auto"
    # Decode attention: "alone" (each row through SDPA, eager steps), "chunks" (the chunked
    # algorithm, which compiles) or "auto" (alone on the CPU; kv/row_attention.py).
    deterministic_attention: str = "auto"

    @property
    def deterministic_rows_alone(self) -> bool | None:
        """DeterministicModel's rows_alone (None: the device's default)."""
        return (
            None
            if self.deterministic_attention == "auto"
            else (self.deterministic_attention == "alone")
        )

    @property
    def kv_codec(self) -> KVCodec:
        return checked_codec(
            self.kv_bits,
            self.kv_group_size,
            self.quantized_kv_start,
            SCHEMES[self.kv_scheme],
            self.kv_value_bits,
        )

    def __post_init__(self) -> None:
        if self.store_region_bytes < -1:
            raise ValueError("--store-region-bytes must be -1 (sized for the backend), 0 or more")
        if self.max_running < 1 or self.max_queued < 0:
            raise ValueError("--max-running must be >= 1 and --max-queued >= 0")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError("--dtype must be auto, float32, bfloat16 or float16")
        if self.kv_scheme not in SCHEMES:
            raise ValueError(f"--kv-scheme must be affine or turboquant, got {self.kv_scheme!r}")
        try:
            self.kv_codec  # noqa: B018  (checks the flags)
        except ValueError as exc:
            raise ValueError("--" + str(exc).replace("_", "-")) from exc
        if not 0 <= self.num_draft_tokens <= MAX_DRAFT:
            raise ValueError(f"--num-draft-tokens must be in 0..{MAX_DRAFT}")
        if self.admission_window_s < 0:
            raise ValueError("--admission-window must be >= 0")
        if self.compiled_decode_max_batch < 0:
            raise ValueError("--compiled-decode-max-batch must be >= 0")
        if self.constraint_compile_timeout_s <= 0:
            raise ValueError("--constraint-compile-timeout must be > 0")
        if self.park_after_tokens < 0 or self.park_bytes < 0 or self.park_idle_timeout_s <= 0:
            raise ValueError(
                "--park-after-tokens and --park-bytes must be >= 0, --park-idle-timeout > 0"
            )
        if self.turn_tokens < 0:
            raise ValueError("--turn-tokens must be >= 0")
        if self.num_draft_tokens and not self.draft_model:
            raise ValueError("--num-draft-tokens needs --draft-model")
        if self.deterministic and (self.draft_model or self.kv_codec.quantized):
            raise ValueError(
                "--deterministic runs plain KV without a draft model (speculative verify "
                "steps and KV codecs are not batch-invariant)"
            )
        if self.deterministic_rows < 0:
            raise ValueError("--deterministic-rows must be >= 0")
        if self.announce:
            ValkeyTarget.parse(self.announce, "--announce")
        if self.announce_interval_s <= 0:
            raise ValueError("--announce-interval-s must be > 0")
        host, colon, port = self.announce_address.rpartition(":")
        if self.announce_address and not (colon and host and port.isdigit()):
            raise ValueError(f"--announce-address wants HOST:PORT, not {self.announce_address!r}")


ENV = EnvDefaults("TANDEM_ENGINE_")


def names_a_directory(spec: str) -> bool:
    """A --model that can only be a local directory: it starts with /, ./, ../ or ~, or has
    more slashes than a hub id (OWNER/NAME)."""
    return spec.startswith(("/", "./", "../", "~")) or spec in (".", "..") or spec.count("/") > 1


def missing_model_directory(spec: str) -> str:
    """What is wrong with a --model naming a local directory that is not there ("" if
    nothing): said in one line at start-up, never a hub lookup of a path."""
    if names_a_directory(spec) and not Path(spec).expanduser().is_dir():
        return f"no model directory at {spec}"
    return ""


def parse_args(argv: list[str] | None = None) -> EngineConfig:
    p = argparse.ArgumentParser(
        prog="tandem-engine", description="Serve an mlx-lm model over gRPC."
    )
    p.add_argument(
        "--model",
        default=ENV("MODEL", ""),
        help="model directory or hub id; empty = the embedded default (tandem-tiny)",
    )
    add_listen_arg(p, ENV, "127.0.0.1:50051")
    p.add_argument("--store", default=ENV("STORE", ""), help="store address (HOST:PORT)")
    p.add_argument(
        "--data-dir",
        default=ENV("DATA_DIR", ".tandem"),
        help="where embedded models are built and cached",
    )
    p.add_argument(
        "--dtype",
        default=ENV("DTYPE", "auto"),
        help="auto (float32 on CPU), float32, bfloat16, float16",
    )
    p.add_argument("--max-running", type=int, default=ENV.integer("MAX_RUNNING", 32))
    p.add_argument("--max-queued", type=int, default=ENV.integer("MAX_QUEUED", 256))
    p.add_argument("--max-context", type=int, default=ENV.integer("MAX_CONTEXT", 0))
    p.add_argument("--prefill-step-size", type=int, default=ENV.integer("PREFILL_STEP", 2048))
    p.add_argument("--default-max-tokens", type=int, default=ENV.integer("DEFAULT_MAX_TOKENS", 256))
    add_grace_arg(p, ENV)
    p.add_argument(
        "--checkpoint-interval",
        type=int,
        default=ENV.integer("CHECKPOINT_INTERVAL", 0),
        help="checkpoint generations every N tokens (needs --store); 0 = off",
    )
    p.add_argument(
        "--prefix-cache-bytes", type=int, default=ENV.integer("PREFIX_CACHE_BYTES", 512 << 20)
    )
    p.add_argument(
        "--spill-queue-bytes", type=int, default=ENV.integer("SPILL_QUEUE_BYTES", 1 << 30)
    )
    p.add_argument(
        "--switch-interval",
        type=float,
        default=ENV.real("SWITCH_INTERVAL", 0.001),
        help="Python GIL switch interval in seconds (see front/server.py)",
    )
    p.add_argument(
        "--admission-window",
        type=float,
        default=ENV.real("ADMISSION_WINDOW", 0.002),
        help="seconds the loop gathers a burst of arrivals into one prefill (0: off)",
    )
    p.add_argument(
        "--constraint-compile-timeout",
        type=float,
        default=ENV.real("CONSTRAINT_COMPILE_TIMEOUT", 10),
        help="seconds a constraint may take to compile before it is refused as too complex",
    )
    p.add_argument(
        "--park-after-tokens",
        type=int,
        default=ENV.integer("PARK_AFTER_TOKENS", 256),
        help="a stream whose client has not read this many tokens gives its slot up (0: never)",
    )
    p.add_argument(
        "--park-bytes",
        type=int,
        default=ENV.integer("PARK_BYTES", 1 << 30),
        help="bytes of caches parked rows may hold at once",
    )
    p.add_argument(
        "--park-idle-timeout",
        type=float,
        default=ENV.real("PARK_IDLE_TIMEOUT", 300),
        help="seconds a parked stream waits for its client before it is cancelled",
    )
    p.add_argument(
        "--turn-tokens",
        type=int,
        default=ENV.integer("TURN_TOKENS", 512),
        help="while requests wait for a full batch, a row gives its slot up after this many "
        "tokens and queues again (0: never)",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        default=ENV.integer("KV_BITS", 0),
        help="quantize full-attention KV caches by default: 4 or 8 bits affine, 2-4 bits "
        "TurboQuant keys (0: plain)",
    )
    p.add_argument(
        "--kv-scheme",
        choices=sorted(SCHEMES),
        default=ENV("KV_SCHEME", "affine"),
        help="how quantized KV rows are coded: affine (mlx-lm's) or turboquant",
    )
    p.add_argument(
        "--kv-value-bits",
        type=int,
        default=ENV.integer("KV_VALUE_BITS", 0),
        help="TurboQuant's value bits, 2-4 (0: --kv-bits)",
    )
    p.add_argument("--kv-group-size", type=int, default=ENV.integer("KV_GROUP_SIZE", 64))
    p.add_argument(
        "--quantized-kv-start",
        type=int,
        default=ENV.integer("QUANTIZED_KV_START", 0),
        help="tokens a row holds in the model's dtype before it converts",
    )
    p.add_argument(
        "--draft-model",
        default=ENV("DRAFT_MODEL", ""),
        help="draft model for speculative decoding (embedded name, directory or hub id)",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=ENV.integer("NUM_DRAFT_TOKENS", 0),
        help="draft tokens per round for requests that do not choose (0: no speculation)",
    )
    add_tls_args(p, ENV)
    add_auth_args(p, ENV)
    add_log_args(p, ENV)
    p.add_argument(
        "--log-prompts",
        action="store_true",
        default=ENV.flag("LOG_PROMPTS"),
        help="put each prompt's token ids in its request log line (they are user data)",
    )
    add_store_link_args(p, ENV)
    add_metrics_arg(p, ENV)
    add_valkey_args(
        p, ENV, "announce", "a Valkey cluster to announce this engine in, for gateways' --discover"
    )
    p.add_argument(
        "--announce-address",
        default=ENV("ANNOUNCE_ADDRESS", ""),
        help="HOST:PORT gateways should dial (default: the listen address as bound; a "
        "wildcard host is announced as this machine's host name)",
    )
    p.add_argument(
        "--announce-interval-s",
        type=float,
        default=ENV.real("ANNOUNCE_INTERVAL_S", 2.0),
        help="seconds between heartbeats; an announcement expires after three",
    )
    add_off_switch(p, ENV, "warmup", "skip running the batch shapes once before serving")
    add_off_switch(
        p, ENV, "compiled_decode", "build each decode step's graph in Python, not compiled"
    )
    p.add_argument(
        "--compiled-decode-max-batch",
        type=int,
        default=ENV.integer("COMPILED_DECODE_MAX_BATCH", 8),
        help="largest batch whose decode step runs compiled (larger ones build it in Python)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        default=ENV.flag("DETERMINISTIC"),
        help="a row's tokens do not depend on the rest of its batch (docs/determinism.md)",
    )
    p.add_argument(
        "--deterministic-rows",
        type=int,
        default=ENV.integer("DETERMINISTIC_ROWS", 0),
        help="rows per decode matmul block in deterministic mode (0: 128 on a GPU; on the CPU 8 "
        "where the model's projections keep a row's bits at every place of such a block, else 1)",
    )
    p.add_argument(
        "--deterministic-matmul",
        choices=["auto", "blocks", "kernel"],
        default=ENV("DETERMINISTIC_MATMUL", "auto"),
        help="deterministic projections: padded row blocks, the invariant kernel (MLX-CUDA "
        "only), or auto: the kernel where it runs (docs/determinism.md)",
    )
    p.add_argument(
        "--deterministic-attention",
        choices=["auto", "alone", "chunks"],
        default=ENV("DETERMINISTIC_ATTENTION", "auto"),
        help="deterministic decode attention: each row alone through SDPA (steps eager), in "
        "chunks from each row's start (steps compile), or auto: alone on the CPU",
    )
    a = p.parse_args(argv)
    try:
        for flag, spec in (("--model", a.model), ("--draft-model", a.draft_model)):
            if missing_model_directory(spec):
                raise ValueError(f"{flag}: {missing_model_directory(spec)}")
        return EngineConfig(
            model=a.model,
            listen=a.listen,
            store=a.store,
            data_dir=Path(a.data_dir),
            dtype=a.dtype,
            max_running=a.max_running,
            max_queued=a.max_queued,
            max_context=a.max_context,
            prefill_step_size=a.prefill_step_size,
            # Deterministic: each prompt prefilled alone, at chunk boundaries from its start.
            prefill_batch_size=1 if a.deterministic else min(8, a.max_running),
            default_max_tokens=a.default_max_tokens,
            grace_s=a.grace,
            switch_interval_s=a.switch_interval,
            admission_window_s=a.admission_window,
            park_after_tokens=a.park_after_tokens,
            park_bytes=a.park_bytes,
            park_idle_timeout_s=a.park_idle_timeout,
            turn_tokens=a.turn_tokens,
            constraint_compile_timeout_s=a.constraint_compile_timeout,
            checkpoint_interval=a.checkpoint_interval,
            prefix_cache_bytes=a.prefix_cache_bytes,
            spill_queue_bytes=a.spill_queue_bytes,
            store_tls_ca=a.store_tls_ca,
            store_tls_cert=a.store_tls_cert,
            store_tls_key=a.store_tls_key,
            store_token_file=a.store_token_file,
            store_region_bytes=a.store_region_bytes,
            store_direct_reads=a.store_direct_reads,
            spill_batch_records=a.spill_batch_records,
            log_prompts=a.log_prompts,
            warmup=a.warmup,
            compiled_decode=a.compiled_decode,
            compiled_decode_max_batch=a.compiled_decode_max_batch,
            kv_bits=a.kv_bits,
            kv_group_size=a.kv_group_size,
            quantized_kv_start=a.quantized_kv_start,
            kv_scheme=a.kv_scheme,
            kv_value_bits=a.kv_value_bits,
            draft_model=a.draft_model,
            num_draft_tokens=a.num_draft_tokens,
            deterministic=a.deterministic,
            deterministic_rows=a.deterministic_rows,
            deterministic_matmul=a.deterministic_matmul,
            deterministic_attention=a.deterministic_attention,
            announce=a.announce,
            announce_password_file=a.announce_password_file,
            announce_address=a.announce_address,
            announce_interval_s=a.announce_interval_s,
            **config_fields(a, TlsFlags, AuthFlags, LogFlags, MetricsFlags),
        )
    except ValueError as exc:
        p.error(str(exc))
