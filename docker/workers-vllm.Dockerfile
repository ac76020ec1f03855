# syntax=docker/dockerfile:1
# The rljob GPU worker image: everything docker/workers.Dockerfile has plus vLLM (`engine: vllm`),
# on vLLM's official image, whose CUDA, torch and vLLM builds fit each other; rljob's packages are
# installed around them without moving torch or vLLM. examples/rljob-search-r1.yaml names it for
# rollout workers and trainers alike, so both sides run the same torch and transformers. Build from
# the repository root, with the HotpotQA sample as the named build context `hotpotqa` (BuildKit):
#   docker build -f docker/workers-vllm.Dockerfile --build-context hotpotqa=../shared/data/hotpotqa \
#     -t rljob-workers-vllm .
# VLLM_VERSION must be >= v0.10.2 for behaviour log-probs of the sampled distribution (vllm_engine.py).
ARG VLLM_VERSION=v0.11.0

# Stands in for the `hotpotqa` build context when none is given: fail with the command to use
# rather than try to pull an image called "hotpotqa".
FROM python:3.11.11-slim-bookworm AS hotpotqa
RUN echo "missing build context: add --build-context hotpotqa=DIR (a folder holding train.jsonl and dev.jsonl," \
         "e.g. ../shared/data/hotpotqa)" >&2 && exit 1

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

# The sample (CC BY-SA 4.0, its README.md says so) where rljob.assets.hotpotqa_dir() looks first,
# so `bundled:train.jsonl` / `bundled:dev.jsonl` work here too. Not under /data: a job's
# data.volumeClaim is mounted there.
COPY --from=hotpotqa train.jsonl dev.jsonl README.md /opt/rljob/data/hotpotqa/
ENV RLJOB_DATA_DIR=/opt/rljob/data/hotpotqa

# uid 1000 matches the runAsUser the operator renders for worker pods (some CUDA bases already have it).
RUN id -u 1000 >/dev/null 2>&1 \
    || (groupadd --gid 1000 rljob && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin rljob)
USER 1000:1000
WORKDIR /tmp
ENTRYPOINT ["rljob"]
CMD ["--help"]
