# syntax=docker/dockerfile:1
# The rljob worker image: rollout workers (`rljob rollout`) and trainers (`rljob train`), with the
# transformers engine (`engine: hf`), hub data (`data.source: hub`) and the HotpotQA sample that
# `bundled:train.jsonl` / `bundled:dev.jsonl` name (examples/rljob-tiny.yaml). Build from the
# repository root, giving the sample folder as the named build context `hotpotqa` (BuildKit):
#   docker build -f docker/workers.Dockerfile --build-context hotpotqa=../shared/data/hotpotqa -t rljob-workers .
# For `engine: vllm` build docker/workers-vllm.Dockerfile instead.

# Stands in for the `hotpotqa` build context when none is given: fail with the command to use
# rather than try to pull an image called "hotpotqa".
FROM python:3.11.11-slim-bookworm AS hotpotqa
RUN echo "missing build context: add --build-context hotpotqa=DIR (a folder holding train.jsonl and dev.jsonl," \
         "e.g. ../shared/data/hotpotqa)" >&2 && exit 1

FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp HF_HOME=/tmp/hf
WORKDIR /src
COPY pyproject.toml README.md ./
COPY workers/ workers/
COPY operator/ operator/
RUN pip install ".[workers,hub]" && rm -rf /src

# The sample (CC BY-SA 4.0, its README.md says so) where rljob.assets.hotpotqa_dir() looks first.
# Not under /data: a job's data.volumeClaim is mounted there.
COPY --from=hotpotqa train.jsonl dev.jsonl README.md /opt/rljob/data/hotpotqa/
ENV RLJOB_DATA_DIR=/opt/rljob/data/hotpotqa

# uid 1000 matches the runAsUser the operator renders for worker pods.
RUN groupadd --gid 1000 rljob && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin rljob
USER 1000:1000
WORKDIR /tmp
ENTRYPOINT ["rljob"]
CMD ["--help"]
