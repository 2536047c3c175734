# The mlx-fleet operator image (charts/mlx-fleet runs `mlx-fleet-operator` in it).
# Unbuilt and untested here: this project's machines have no Docker engine. scripts/kind-up.sh
# builds it (`docker build -t mlx-fleet-operator:dev .`); tests/test_packaging.py checks it
# statically against the chart (user, ports, entry point).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY mlx_fleet ./mlx_fleet
COPY operator ./operator
COPY node_agent ./node_agent
COPY router ./router
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
# Non-root, matching the chart's podSecurityContext (runAsUser/runAsGroup 65532). The root
# filesystem may be read-only: Python writes nothing but under HOME=/tmp (an emptyDir there).
USER 65532:65532
ENV HOME=/tmp PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# /metrics (--metrics-port) and kopf's /healthz (--liveness-port), the chart's defaults
EXPOSE 8080 8081
ENTRYPOINT ["mlx-fleet-operator"]
