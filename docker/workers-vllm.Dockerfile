# syntax=docker/dockerfile:1
# The rljob GPU worker image: everything docker/workers.Dockerfile has plus vLLM (`engine: vllm`),
# on vLLM's official image, whose CUDA, torch and vLLM builds fit each other; rljob's packages are
# installed around them without moving torch or vLLM. examples/rljob-search-r1.yaml names it for
# rollout workers and trainers alike, so both sides run the same torch and transformers. The
# HotpotQA sample behind `bundled:train.jsonl` / `bundled:dev.jsonl` is package data of rljob, so
# the install below carries it. Build from the repository root:
#   docker build -f docker/workers-vllm.Dockerfile -t rljob-workers-vllm .
# VLLM_VERSION must be >= v0.10.2 for behaviour log-probs of the sampled distribution (vllm_engine.py).
ARG VLLM_VERSION=v0.11.0

FROM vllm/vllm-openai:${VLLM_VERSION}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 HOME=/tmp HF_HOME=/tmp/hf
WORKDIR /src
COPY pyproject.toml README.md ./
COPY workers/ workers/
COPY operator/ operator/
# The base image's vllm, torch and transformers are pinned as constraints: `.[workers,hub]` only adds.
RUN python3 -m pip freeze | grep -iE '^(vllm|torch|transformers)==' > /tmp/keep.txt \
    && python3 -m pip install -c /tmp/keep.txt ".[workers,hub]" \
    && python3 -c "import vllm, rljob.engines.vllm_engine, datasets" \
    && rm -rf /src /tmp/keep.txt

# uid 1000 matches the runAsUser the operator renders for worker pods (some CUDA bases already have it).
RUN id -u 1000 >/dev/null 2>&1 \
    || (groupadd --gid 1000 rljob && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin rljob)
USER 1000:1000
WORKDIR /tmp
ENTRYPOINT ["rljob"]
CMD ["--help"]
