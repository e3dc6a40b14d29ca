# rubricsearch API and ingestion-worker image (compose.yaml runs it as `serve` and as `worker`).
#   docker build -t rubricsearch .
#   docker run --rm rubricsearch --help
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RUBRICSEARCH_DATA_DIR=/data \
    RUBRICSEARCH_HOST=0.0.0.0 \
    HF_HOME=/hf-cache

WORKDIR /opt/rubricsearch

# Dependencies first, against empty packages, so a source change does not reinstall torch.
COPY pyproject.toml README.md ./
RUN mkdir -p rubricsearch && touch rubricsearch/__init__.py \
    && pip install ".[qdrant,postgres]" \
    && pip uninstall -y rubricsearch

COPY app ./app
COPY retrieval ./retrieval
COPY rerank ./rerank
COPY indexer ./indexer
COPY web ./web
COPY rubricsearch ./rubricsearch
RUN pip install --no-deps . && rm -rf build ./*.egg-info

# Non-root; the data and model-cache mount points belong to it (a fresh named volume copies this ownership).
RUN useradd --system --create-home --uid 10001 --shell /usr/sbin/nologin rubricsearch \
    && mkdir -p /data /hf-cache \
    && chown rubricsearch:rubricsearch /data /hf-cache
USER rubricsearch
WORKDIR /data
VOLUME ["/data"]
EXPOSE 8000

ENTRYPOINT ["rubricsearch"]
CMD ["serve"]
