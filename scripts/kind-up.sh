#!/usr/bin/env bash
# Bring up mlx-fleet's Kubernetes side on a local kind cluster (needs Docker): an etcd reachable
# by the Macs, the CRDs, and the operator from the Helm chart. See docs/kind.md.
#
# NOT RUN IN THE PROJECT'S CI: the project's machines have no Docker engine, so this path has
# never been executed there. The local control plane the project does test is `scripts/dev.sh`.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

cluster=mlx-fleet
namespace=mlx-system
etcd_mode=in-cluster
etcd_endpoint=""
etcd_image=quay.io/coreos/etcd:v3.6.16
etcd_host_port=2379
etcd_listen=127.0.0.1
insecure_etcd=0
image=mlx-fleet-operator:dev
build_image=1
model_dir=""
down=0

usage() {
  cat <<EOF
Usage: scripts/kind-up.sh [options]

Create a kind cluster, run etcd, install the mlx-fleet CRDs and the Helm chart (operator).
Node agents then run on the Macs, pointed at the etcd this prints.
Not run in the project's CI (no Docker there): see docs/kind.md.

Options:
  --name NAME              kind cluster name (default: $cluster)
  --namespace NS           namespace for the operator and etcd (default: $namespace)
  --etcd-endpoint URL      use an external etcd (one client URL, http://host:port, reachable
                           from the pods and the Macs) instead of deploying one in the cluster;
                           a plain http:// one needs --insecure-etcd-http
  --insecure-etcd-http     accept the external plain-http etcd of --etcd-endpoint (the chart's
                           insecure.etcdHttp; development only)
  --etcd-image IMAGE       etcd image for the in-cluster etcd (default: $etcd_image)
  --etcd-host-port PORT    host port the in-cluster etcd is published on for the Macs
                           (default: $etcd_host_port)
  --etcd-listen ADDR       host address it is published on (default: $etcd_listen, this machine
                           only: agents on this machine). To let the Macs reach it give this
                           machine's LAN address or 0.0.0.0: an etcd WITHOUT authentication on
                           the LAN, anyone there can assign any model to every Mac
  --image REPO:TAG         operator image (default: $image)
  --no-build-image         do not build the operator image; IMAGE must be pullable or loaded
  --example MODEL_DIR      also apply examples/modeldeployment.yaml with \${MODEL_DIR}=MODEL_DIR
                           (the model directory's absolute path on the Macs)
  --down                   delete the kind cluster and exit
  -h, --help               show this help

Needs on PATH: docker, kind, kubectl, helm (and envsubst for --example).
EOF
}

log() { printf '\033[1;34m[kind-up]\033[0m %s\n' "$*" >&2; }
die() { printf '\033[1;31m[kind-up] error:\033[0m %s\n' "$*" >&2; exit 1; }
need() { command -v "$1" >/dev/null 2>&1 || die "$1 is required on PATH ($2)"; }
arg() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (see --help)"; }

while [ $# -gt 0 ]; do
  case $1 in
    --name) arg "$@"; cluster=$2; shift 2 ;;
    --namespace) arg "$@"; namespace=$2; shift 2 ;;
    --etcd-endpoint) arg "$@"; etcd_mode=external; etcd_endpoint=$2; shift 2 ;;
    --etcd-image) arg "$@"; etcd_image=$2; shift 2 ;;
    --etcd-host-port) arg "$@"; etcd_host_port=$2; shift 2 ;;
    --etcd-listen) arg "$@"; etcd_listen=$2; shift 2 ;;
    --insecure-etcd-http) insecure_etcd=1; shift ;;
    --image) arg "$@"; image=$2; shift 2 ;;
    --no-build-image) build_image=0; shift ;;
    --example) arg "$@"; model_dir=$2; shift 2 ;;
    --down) down=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option: $1" ;;
  esac
done

if [ "$down" = 1 ]; then
  :
elif [ "$etcd_mode" = in-cluster ]; then
  case $etcd_listen in
    127.*|localhost|::1) ;;
    *) log "WARNING: --etcd-listen $etcd_listen publishes an etcd without authentication beyond this machine: anyone who reaches $etcd_listen:$etcd_host_port can assign any model to every Mac (development only; docs/kind.md)" ;;
  esac
elif [ "$insecure_etcd" = 0 ]; then
  case $etcd_endpoint in
    https://*) ;;
    *) die "--etcd-endpoint $etcd_endpoint is plain http: give --insecure-etcd-http to accept it (development only), or use an https:// etcd and install the chart by hand with etcd.tls.secretName (docs/security.md)" ;;
  esac
fi

need kind "https://kind.sigs.k8s.io/docs/user/quick-start/#installation"
if [ "$down" = 1 ]; then
  kind delete cluster --name "$cluster"
  exit 0
fi
need docker "Docker Desktop, colima or another Docker engine"
need kubectl "https://kubernetes.io/docs/tasks/tools/"
need helm "https://helm.sh/docs/intro/install/ (or: python -c 'from mlx_fleet.devcluster.helm import ensure_helm; print(ensure_helm())')"
[ -z "$model_dir" ] || need envsubst "gettext"
case $model_dir in ""|/*) ;; *) die "--example needs an absolute path, got: $model_dir" ;; esac
docker info >/dev/null 2>&1 || die "the Docker engine is not reachable (is it running?)"

# --- 1. kind cluster, publishing the etcd NodePort on the host so the Macs can reach it --------
etcd_node_port=32379
if kind get clusters 2>/dev/null | grep -qx "$cluster"; then
  log "kind cluster $cluster exists; reusing it"
else
  log "creating kind cluster $cluster"
  kind create cluster --name "$cluster" --wait 120s --config - <<EOF
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
    extraPortMappings:
      - containerPort: $etcd_node_port
        hostPort: $etcd_host_port
        listenAddress: "$etcd_listen"
        protocol: TCP
EOF
fi
kubectl config use-context "kind-$cluster" >/dev/null
kubectl create namespace "$namespace" --dry-run=client -o yaml | kubectl apply -f - >/dev/null

# --- 2. etcd -------------------------------------------------------------------------------------
if [ "$etcd_mode" = in-cluster ]; then
  log "deploying a single-member etcd ($etcd_image) in $namespace (plain HTTP, no auth: development only)"
  kubectl apply -n "$namespace" -f - <<EOF
apiVersion: v1
kind: Service
metadata:
  name: etcd
  labels: {app.kubernetes.io/name: etcd, app.kubernetes.io/part-of: mlx-fleet}
spec:
  clusterIP: None
  selector: {app.kubernetes.io/name: etcd}
  ports: [{name: client, port: 2379}]
---
apiVersion: v1
kind: Service
metadata:
  name: etcd-external
  labels: {app.kubernetes.io/name: etcd, app.kubernetes.io/part-of: mlx-fleet}
spec:
  type: NodePort
  selector: {app.kubernetes.io/name: etcd}
  ports: [{name: client, port: 2379, nodePort: $etcd_node_port}]
---
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: etcd
  labels: {app.kubernetes.io/name: etcd, app.kubernetes.io/part-of: mlx-fleet}
spec:
  serviceName: etcd
  replicas: 1
  selector:
    matchLabels: {app.kubernetes.io/name: etcd}
  template:
    metadata:
      labels: {app.kubernetes.io/name: etcd, app.kubernetes.io/part-of: mlx-fleet}
    spec:
      containers:
        - name: etcd
          image: $etcd_image
          command:
            - etcd
            - --name=etcd-0
            - --data-dir=/var/lib/etcd
            - --listen-client-urls=http://0.0.0.0:2379
            - --advertise-client-urls=http://etcd-0.etcd.$namespace.svc:2379
            - --listen-peer-urls=http://0.0.0.0:2380
            - --initial-advertise-peer-urls=http://etcd-0.etcd.$namespace.svc:2380
            - --initial-cluster=etcd-0=http://etcd-0.etcd.$namespace.svc:2380
            - --auto-compaction-mode=revision
            - --auto-compaction-retention=10000
          ports: [{name: client, containerPort: 2379}, {name: peer, containerPort: 2380}]
          readinessProbe:
            httpGet: {path: /health, port: client}
            periodSeconds: 5
          volumeMounts: [{name: data, mountPath: /var/lib/etcd}]
  volumeClaimTemplates:
    - metadata: {name: data}
      spec:
        accessModes: [ReadWriteOnce]
        resources: {requests: {storage: 1Gi}}
EOF
  kubectl -n "$namespace" rollout status statefulset/etcd --timeout=180s
  etcd_endpoint="http://etcd.$namespace.svc:2379"
fi

# --- 3. CRDs and the operator ----------------------------------------------------------------------
log "installing the CRDs from crds/"
kubectl apply --server-side -f "$repo/crds/"
kubectl wait --for=condition=Established --timeout=60s -f "$repo/crds/"

if [ "$build_image" = 1 ]; then
  log "building the operator image $image and loading it into kind"
  docker build -t "$image" "$repo"  # the repository's Dockerfile
  kind load docker-image "$image" --name "$cluster"
fi

# The router's API key: the chart runs it behind keys (docs/security.md); a random one here.
if ! kubectl -n "$namespace" get secret mlx-fleet-router-api-keys >/dev/null 2>&1; then
  log "creating the router's API key (Secret mlx-fleet-router-api-keys)"
  router_key="sk-$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  kubectl -n "$namespace" create secret generic mlx-fleet-router-api-keys \
    --from-literal=api-keys="$router_key" >/dev/null
  unset router_key
fi

log "installing the chart charts/mlx-fleet (etcd: $etcd_endpoint)"
# The in-cluster etcd this script deployed is plain http without auth (development only): the
# chart's explicit opt-out (insecure.etcdHttp), and no client certificate (etcd.tls.secretName
# empty). An external etcd gets the opt-out only with --insecure-etcd-http (checked above).
insecure_http=false
if [ "$etcd_mode" = in-cluster ] || [ "$insecure_etcd" = 1 ]; then
  insecure_http=true
  log "WARNING: plain-http etcd without authentication (insecure.etcdHttp=true): development only"
fi

# the example's model directory is on the Macs: the fleet's source policy lists it explicitly
# (docs/security.md, "Source policy"); the agents need the same --source-policy
policy=()
[ -z "$model_dir" ] || policy=(--set-json "sourcePolicy={\"fileRoots\": [\"$model_dir\"]}")
# The router's port is plain http here (reached through kubectl port-forward on loopback): the
# chart's explicit opt-out insecure.httpListen; a real cluster names a TLS Secret instead.
helm upgrade --install mlx-fleet "$repo/charts/mlx-fleet" \
  --namespace "$namespace" \
  --set "image.repository=${image%:*}" --set "image.tag=${image##*:}" \
  --set "image.pullPolicy=IfNotPresent" \
  --set "etcd.endpoints={${etcd_endpoint}}" \
  --set "etcd.tls.secretName=" --set "insecure.etcdHttp=$insecure_http" \
  --set "router.tls.secretName=" --set "insecure.httpListen=true" \
  ${policy[@]+"${policy[@]}"} \
  --wait --timeout 5m
# Helm installs crds/ on first install only; the kubectl apply above keeps them current.

# --- 4. optional example ----------------------------------------------------------------------------
if [ -n "$model_dir" ]; then
  log "applying examples/modeldeployment.yaml with MODEL_DIR=$model_dir"
  MODEL_DIR=$model_dir envsubst '${MODEL_DIR}' < "$repo/examples/modeldeployment.yaml" | kubectl apply -f -
fi

# --- 5. what the Macs need --------------------------------------------------------------------------
if [ "$etcd_mode" = in-cluster ]; then
  agent_etcd="http://<this-machine's-LAN-address>:$etcd_host_port"
  [ "$etcd_listen" = 0.0.0.0 ] || agent_etcd="http://$etcd_listen:$etcd_host_port"
else
  agent_etcd=$etcd_endpoint
fi
# the agents' own rule (mlx_fleet/exposure.py): a plain-http etcd beyond loopback needs the flag
agent_insecure=" --insecure-etcd-http"
case $agent_etcd in
  https://*|http://127.*|http://localhost:*|http://\[::1\]:*) agent_insecure="" ;;
esac
agent_policy=""
[ -z "$model_dir" ] || agent_policy=" --source-policy '{\"fileRoots\": [\"$model_dir\"]}'"
cat >&2 <<EOF

mlx-fleet is up on kind cluster "$cluster" (namespace $namespace).
  kubectl get md -A            # ModelDeployments
  kubectl -n $namespace logs deploy/mlx-fleet
  kubectl -n $namespace port-forward svc/mlx-fleet-router 8090:80   # the fleet router: http://127.0.0.1:8090/v1
  kubectl -n $namespace get secret mlx-fleet-router-api-keys -o jsonpath='{.data.api-keys}' | base64 -d   # its key

On every Mac, run the node agent pointed at the same etcd:
  mlx-fleet-agent --etcd-endpoint $agent_etcd$agent_insecure --api-key-file <keys> \
    --listen 0.0.0.0:<port> --insecure-http-listen \
    --advertise-url http://<the-mac's-address>:<port>$agent_policy
(see docs/kind.md and mlx-fleet-agent --help).
Tear down: scripts/kind-up.sh --name $cluster --down
EOF
