# batchgate API: `batchgate serve` (gunicorn serving the app factory). Run the supervisor from the same image with
#   docker run ... batchgate supervisor
# Point both at a real Redis with BATCHGATE_REDIS_URL and set BATCHGATE_TOKENS.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    BATCHGATE_HOST=0.0.0.0 BATCHGATE_PORT=8080 BATCHGATE_DATA_DIR=/data

WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY connectors ./connectors
COPY chunker ./chunker
RUN pip install --no-cache-dir . \
    && useradd --create-home --uid 10001 batchgate \
    && mkdir -p /data && chown batchgate /data

USER batchgate
EXPOSE 8080
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status != 200)"
# `batchgate serve`: gunicorn with gateway/runtime/gunicorn_conf.py on BATCHGATE_HOST:BATCHGATE_PORT; without
# BATCHGATE_REDIS_URL it exits 2 at once, saying so, instead of answering 503 to every request
CMD ["batchgate", "serve"]
