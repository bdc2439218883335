# syntax=docker/dockerfile:1
# One image for every prefixgate process: the gateway and the prefill/decode nodes differ only
# in their command (see docker-compose.yml). Default command: the whole stack in one container.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# Optional extras, e.g. --build-arg EXTRAS=hf for Hugging Face tokenizers.
ARG EXTRAS=""

# Dependency layer: pyproject.toml and an empty package skeleton only, so this layer is rebuilt
# when the dependencies change, not on every source edit.
COPY pyproject.toml deploy/skeleton.py /tmp/deps/
RUN python /tmp/deps/skeleton.py /tmp/deps \
 && pip install "setuptools>=69" wheel \
 && pip install "/tmp/deps${EXTRAS:+[$EXTRAS]}" \
 && pip uninstall -y prefixgate \
 && rm -rf /tmp/deps

# Source layer: the package itself, no dependency resolution, no network.
WORKDIR /app
COPY . /app
RUN pip install --no-deps --no-build-isolation /app \
 && rm -rf /app/build /app/*.egg-info

RUN useradd --system --uid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin prefixgate
USER 10001:10001

# 8000: HTTP API (/v1, /healthz, /readyz, /metrics, /admin); 50051: gRPC (gateway front end or node).
EXPOSE 8000 50051

# http://… checks the gateway's /healthz, grpc://… the standard gRPC health of a node;
# docker-compose.yml sets PREFIXGATE_HEALTHCHECK per service.
ENV PREFIXGATE_HEALTHCHECK=http://127.0.0.1:8000/healthz
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "/app/deploy/healthcheck.py"]

CMD ["prefixgate", "up", "--host", "0.0.0.0", "--port", "8000"]
