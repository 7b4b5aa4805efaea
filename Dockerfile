# One image, three commands: tandem-store, tandem-engine, tandem-gateway (docs/operations.md).
# CPU build; for NVIDIA add the extra: pip install '.[cuda]'. Not built in CI (no registry).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends libopenblas0-pthread \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . .
RUN pip install --no-cache-dir . && useradd --create-home tandem && mkdir /data && chown tandem /data
USER tandem
# Each service listens on 0.0.0.0 inside its container: give it --auth-file, or accept
# --insecure-no-auth on a private network (compose below).
EXPOSE 50050 50051 50061 8000 9090
CMD ["tandem-engine", "--help"]
