# syntax=docker/dockerfile:1
# One image, three commands: tandem-store, tandem-engine, tandem-gateway (docs/operations.md,
# docs/deploy.md). Two variants of MLX:
#   docker build -t tandem:0.1.0-cpu .                               # CPU (the default)
#   docker build --build-arg VARIANT=cuda -t tandem:0.1.0-cuda .     # NVIDIA GPUs, CUDA 13
# Not built in CI (no image registry or daemon there); tests/test_deploy.py checks what the
# Kubernetes manifests take from it: the user id and the variants.
ARG PYTHON=3.11

# The server wheel, from only the files it is built from (a clone also holds .venv, .git...).
FROM python:${PYTHON}-slim AS wheel
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY scripts/gen_protos.py scripts/
COPY protos protos
COPY tandem_wire tandem_wire
COPY store_service store_service
COPY engine_service engine_service
COPY gateway_service gateway_service
COPY clients/python/tandem_client clients/python/tandem_client
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:${PYTHON}-slim
ARG VARIANT=cpu
# OpenBLAS for MLX's CPU matmuls (engine_service/blas.py preloads it).
RUN apt-get update && apt-get install -y --no-install-recommends libopenblas0-pthread \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    case "$VARIANT" in \
    cpu) extra="" ;; \
    cuda) extra="[cuda]" ;; \
    *) echo "VARIANT is cpu or cuda, not $VARIANT" >&2; exit 1 ;; \
    esac \
    && pip install --no-cache-dir "tandem${extra} @ file://$(ls /wheels/tandem-*.whl)"
# A numeric user: Kubernetes' runAsNonRoot can check a number, not a name (deploy/ runs the
# pods as 10001). The engine builds its embedded default model in its data directory on
# first start, so that directory is the user's; /data is docker-compose.yml's store volume.
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --create-home tandem \
    && mkdir -p /data /var/lib/tandem/engine /var/lib/tandem/store \
    && chown tandem:tandem /data /var/lib/tandem/engine /var/lib/tandem/store
ENV TANDEM_ENGINE_DATA_DIR=/var/lib/tandem/engine \
    TANDEM_STORE_DATA_DIR=/var/lib/tandem/store \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /var/lib/tandem
# transformers' table of its own modules, scanned once here and kept in the user's cache
# (engine_service/transformers_import.py): each engine process then starts ~1.5 s of CPU
# sooner. It imports no mlx, so it builds on a host without a GPU.
RUN python -c "import engine_service, transformers.models"
# Each service listens on 0.0.0.0 inside its container: give it --auth-file, or accept
# --insecure-no-auth on a private network (docker-compose.yml).
EXPOSE 50050 50051 50061 8000 9090
CMD ["tandem-engine", "--help"]
