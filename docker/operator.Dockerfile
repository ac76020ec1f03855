# The rljob operator image: kopf + the Kubernetes client, no torch.
# Build from the repository root: docker build -f docker/operator.Dockerfile -t rljob-operator .
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY workers/ workers/
COPY operator/ operator/
RUN pip install ".[operator]" && rm -rf /src

RUN groupadd --gid 10001 rljob && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin rljob
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 8081
ENTRYPOINT ["python", "-m", "rljob_operator"]
