# The mlx-fleet operator image (charts/mlx-fleet runs `mlx-fleet-operator` in it, and the fleet
# router from it with command `mlx-fleet-router`: one image, two entry points).
# With a registry: `docker build -t mlx-fleet-operator:dev .` (scripts/kind-up.sh). With none
# (this project's machines): mlx_fleet/devcluster/images.py builds it with buildah on a Python base
# made from Debian packages (BASE_IMAGE) and imports it into containerd; tests/test_real_node.py
# runs it on a real kubelet. tests/test_packaging.py checks it statically against the chart.
# BASE_IMAGE: any image with python3 >= 3.11 and pip on PATH as `python`/`pip`.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY mlx_fleet ./mlx_fleet
COPY operator ./operator
COPY node_agent ./node_agent
COPY router ./router
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${BASE_IMAGE}
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
# Non-root, matching the chart's podSecurityContext (runAsUser/runAsGroup 65532). The root
# filesystem may be read-only: Python writes nothing but under HOME=/tmp (an emptyDir there).
USER 65532:65532
ENV HOME=/tmp PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# /metrics (--metrics-port) and kopf's /healthz (--liveness-port), and the router's API,
# /health and /metrics (--port): the chart's defaults
EXPOSE 8080 8081 8090
ENTRYPOINT ["mlx-fleet-operator"]
