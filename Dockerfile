# batchgate: one image for every process kind. The API is `batchgate serve` (gunicorn serving the app
# factory); the same image runs `batchgate supervisor` and `batchgate worker`. compose.yaml runs them all
# beside a Redis with AOF on. Point them at a real Redis with BATCHGATE_REDIS_URL; give them one settings
# file (BATCHGATE_CONFIG_FILE: tokens, signing key; `batchgate config init` makes it) or the variables.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    BATCHGATE_HOST=0.0.0.0 BATCHGATE_PORT=8080 BATCHGATE_DATA_DIR=/data

RUN useradd --create-home --uid 10001 batchgate \
    && mkdir -p /data /config && chown batchgate /data /config

WORKDIR /app
# Dependencies first, in a layer of their own, from the pinned list (scripts/lock): a change to the
# source reuses this layer instead of installing every dependency again.
COPY requirements.txt ./
RUN pip install --no-cache-dir -r requirements.txt
COPY pyproject.toml README.md LICENSE ./
COPY gateway ./gateway
COPY connectors ./connectors
COPY chunker ./chunker
RUN pip install --no-cache-dir --no-deps .

USER batchgate
# the API's data dir: the callback spool that keeps platforms' answers while Redis restarts
VOLUME /data
# documentation only: the API listens on BATCHGATE_PORT (8080 unless set)
EXPOSE 8080
# this container's process kind is alive: the API answers /livez on BATCHGATE_PORT (compose.yaml gives
# the supervisor and workers `batchgate health supervisor|worker`)
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 CMD ["batchgate", "health", "api"]
# `batchgate serve`: gunicorn with gateway/runtime/gunicorn_conf.py on BATCHGATE_HOST:BATCHGATE_PORT; without
# BATCHGATE_REDIS_URL it exits 2 at once, saying so, instead of answering 503 to every request
CMD ["batchgate", "serve"]
