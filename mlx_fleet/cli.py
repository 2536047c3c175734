"""mlx-fleet: the command line for developers and operators.

Commands:
  provision         build (once) and cache etcd, kube-apiserver, kubectl, helm, prometheus and promtool
                    from the Go module proxy (--node: also what a real node needs)
  dev up / dev down run / stop a local control plane (and optionally operator + agents) on loopback
                    (--node: plus a real kubelet node running the chart's Pods; Linux, root)
  demo              the local demo fleet end to end (the README's first Quick start command)
  make-test-model   write a small real MLX model (random weights, real tokenizer) to a directory
  make-manifest     write a model directory's manifest.json (sizes, sha256) for an https:// mirror
  status            print nodes, assignments and agent reports from etcd (--router: breakers)
  canary            status / promote / abort a Canary (like `kubectl argo rollouts promote`)
  cordon / uncordon NODE  stop / resume placing new replicas on a Mac (its MacNode)
  drain NODE        move every replica off a Mac (replacement Ready first), then wait
  etcd bootstrap-auth     create least-privilege etcd users/roles, enable auth (docs/security.md)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from mlx_fleet.console import make_console, print_step, progress_builder


def _cmd_provision(args: argparse.Namespace) -> int:
    from mlx_fleet.devcluster.binaries import BuildError, ensure_all
    from mlx_fleet.devcluster.helm import ensure_helm
    from mlx_fleet.devcluster.prombuild import ensure_prometheus

    console = make_console(stderr=True)
    try:
        binaries = progress_builder(console, ensure_all)
        helm = progress_builder(console, ensure_helm)  # the chart tests lint and render with it
        # the dashboards' queries are checked against it; promtool lints the expositions
        prom = progress_builder(console, ensure_prometheus)
        if args.node:
            _provision_node(console)
    except BuildError as e:
        console.print(f"[red]build failed:[/] {e}")
        return 1
    if args.print_bin_dir:
        print(os.pathsep.join(map(str, [*binaries.bin_dirs, helm.parent, prom.prometheus.parent])))
    else:
        for name, path in (("etcd", binaries.etcd), ("kube-apiserver", binaries.kube_apiserver),
                           ("kubectl", binaries.kubectl), ("helm", helm),
                           ("prometheus", prom.prometheus), ("promtool", prom.promtool)):
            console.print(f"[green]✓[/] {name}: {path}")
    return 0


def _provision_node(console) -> None:  # noqa: ANN001 - rich Console
    """``provision --node``: what ``dev up --node`` needs, ahead of time (Debian packages, the
    node's Kubernetes components, the pause and Python base images, the operator image)."""
    import time

    from mlx_fleet.devcluster.controlplane import REPO_ROOT
    from mlx_fleet.devcluster.images import build_operator_image
    from mlx_fleet.devcluster.node import NodeFailed, provision

    step = print_step(console)
    try:
        progress_builder(console, lambda progress: provision(step, progress))
    except NodeFailed as e:
        raise BuildError(str(e)) from e
    started = time.monotonic()
    with console.status("building the operator image (buildah; the Debian base on first use)"):
        build_operator_image(REPO_ROOT)
    step("operator image", time.monotonic() - started)


def _state_file() -> Path:
    from mlx_fleet.devcluster.binaries import cache_dir

    return cache_dir() / "dev" / "state.json"


def _cmd_dev_up(args: argparse.Namespace) -> int:
    from mlx_fleet.devcluster.binaries import ensure_all
    from mlx_fleet.devcluster.controlplane import start_control_plane
    from mlx_fleet.devcluster.fleet import start_agent, start_operator, start_router
    from mlx_fleet.devcluster.processes import free_port
    from mlx_fleet.devcluster.prombuild import ensure_prometheus
    from mlx_fleet.devcluster.promserver import ScrapeTarget, start_prometheus

    from mlx_fleet.devcluster.binaries import BuildError
    from mlx_fleet.devcluster.node import NodeFailed
    from mlx_fleet.devcluster.processes import ProcessFailed

    console = make_console(stderr=True)
    node = None
    try:
        binaries = progress_builder(console, ensure_all)
        if args.node:
            from mlx_fleet.devcluster.node import claim_host

            node = claim_host(step=print_step(console))
        with console.status("starting etcd ×2 and kube-apiserver"):
            cp = start_control_plane(Path(args.workdir) if args.workdir else None, binaries=binaries,
                                     keep_workdir=args.keep,
                                     node_name=node.spec.name if node else "",
                                     node_address=node.spec.address if node else "")
    except (BuildError, ProcessFailed, NodeFailed) as e:
        if node is not None:
            node.stop()
        console.print(f"[red]error:[/] {e}")
        return 1
    try:
        prometheus_url = router_url = None
        try:
            if node is not None:
                _start_dev_node(console, cp, node)
            targets = []
            # the router's port is chosen first: the operator shows its URL in status.router
            router_port = (args.router_port or free_port()) if args.router else None
            if args.operator:
                with console.status("starting the operator"):
                    metrics_port = free_port()
                    start_operator(cp, metrics_port=metrics_port, extra_args=(
                        ("--router-url", f"http://127.0.0.1:{router_port}")
                        if router_port else ()))
                    targets.append(ScrapeTarget(f"127.0.0.1:{metrics_port}"))
            for i in range(args.agents):
                with console.status(f"starting agent mac-{i}"):
                    agent = start_agent(cp, f"mac-{i}")
                    targets.append(ScrapeTarget(agent.url.removeprefix("http://"), node=agent.name))
            if args.router:
                with console.status("starting the fleet router"):
                    router_url = start_router(cp, port=router_port).url
                    targets.append(ScrapeTarget(router_url.removeprefix("http://"), router=True))
            if args.prometheus:
                prom_bins = progress_builder(console, ensure_prometheus)
                with console.status("starting Prometheus"):
                    prom = start_prometheus(cp.workdir / "prometheus", targets, interval="5s",
                                            binaries=prom_bins)
                    cp.extra.append(prom.process)
                prometheus_url = prom.url
        except (ProcessFailed, BuildError, NodeFailed) as e:
            console.print(f"[red]error:[/] {e}")
            return 1
        state = {"pid": os.getpid(), "workdir": str(cp.workdir), "kubeconfig": str(cp.kubeconfig),
                 "etcd": cp.etcd_url, "apiserver": cp.apiserver_url, "prometheus": prometheus_url,
                 "router": router_url}
        _state_file().parent.mkdir(parents=True, exist_ok=True)
        _state_file().write_text(json.dumps(state, indent=2))
        console.print(f"[green]control plane up[/] — logs in {cp.logs_dir}\n"
                      f"  export KUBECONFIG={cp.kubeconfig}\n"
                      f"  export MLX_FLEET_ETCD_ENDPOINT={cp.etcd_url}\n"
                      f"  export PATH={os.pathsep.join(map(str, binaries.bin_dirs))}:$PATH\n"
                      + (f"  export MLX_FLEET_ROUTER_URL={router_url}  "
                         "(`mlx-fleet status` shows its breakers)\n"
                         f"Fleet router (one OpenAI endpoint for every model): {router_url}/v1\n"
                         if router_url else "")
                      + (f"Prometheus (operator + agents{' + router' if router_url else ''}, every 5 s): {prometheus_url}  "
                         f"(HTTP API: {prometheus_url}/api/v1/query?query=up)\n"
                         if prometheus_url else "") +
                      "Ctrl-C (or `mlx-fleet dev down`) stops everything.")
        stop = False

        def on_signal(*_: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        while not stop:
            signal.pause()
    finally:
        if node is not None:
            node.stop()
        cp.stop()
        _state_file().unlink(missing_ok=True)
    return 0


def _start_dev_node(console, cp, node) -> None:  # noqa: ANN001 - Console, ControlPlane, Node
    """``dev up --node``: start the real node claimed by ``node``, with the operator image built
    from this repository and imported; prints each step's time and how to install the chart."""
    from mlx_fleet.devcluster.chart import start_chart_node
    from mlx_fleet.devcluster.images import OPERATOR_REF

    step = print_step(console)
    console.print("building the operator image (buildah; the Debian base on first use)")
    progress_builder(console, lambda progress: start_chart_node(cp, node, step=step,
                                                                progress=progress))
    api_port = cp.apiserver_url.rsplit(":", 1)[1]
    proxy = ("kube-proxy running" if node.kube_proxy is not None else
             f"no kube-proxy ({node.kube_proxy_error}); add --set kubernetesAPI.host=127.0.0.1 "
             f"--set kubernetesAPI.port={api_port}")
    from mlx_fleet.source_policy import DEV_POLICY

    repo, tag = OPERATOR_REF.rsplit(":", 1)
    console.print(f"[green]node {cp.node_name} Ready[/] ({proxy}). Install the chart:\n"
                  f"  helm install mlx-fleet charts/mlx-fleet --kubeconfig {cp.kubeconfig} "
                  f"--set image.repository={repo} --set image.tag={tag} --set image.pullPolicy=Never "
                  f"--set hostNetwork=true --set etcd.endpoints={{{cp.etcd_url}}} "
                  f"--set etcd.tls.secretName= "
                  # The router reaches etcd and the agents on loopback too; its port is then the
                  # node's, so this one node holds one router Pod (docs/development.md).
                  f"--set router.hostNetwork=true --set router.port={free_port()} "
                  f"--set router.replicaCount=1 "
                  # a development node: the router without keys, explicitly (docs/security.md)
                  f"--set router.apiKeys.secretName= --set insecure.listenWithoutKeys=true "
                  f"--set router.tls.secretName= "
                  # the dev agents' policy, said explicitly (docs/security.md, Source policy)
                  f"--set-json 'sourcePolicy={DEV_POLICY.to_json()}'", highlight=False)


def _cmd_dev_down(args: argparse.Namespace) -> int:
    path = _state_file()
    if not path.exists():
        print("no local control plane is running (no state file)", file=sys.stderr)
        return 1
    import psutil

    pid = json.loads(path.read_text())["pid"]
    try:
        # The state file outlives a SIGKILLed `dev up` or a reboot; never signal a stranger.
        if "mlx_fleet" not in " ".join(psutil.Process(pid).cmdline()):
            raise psutil.NoSuchProcess(pid)
        os.kill(pid, signal.SIGTERM)
    except (psutil.NoSuchProcess, ProcessLookupError):
        path.unlink(missing_ok=True)
        print(f"stale state file: process {pid} is gone (removed {path})", file=sys.stderr)
        return 1
    print(f"asked `mlx-fleet dev up` (pid {pid}) to stop", file=sys.stderr)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from mlx_fleet.demo import run_demo

    return run_demo(prompt=args.prompt, max_tokens=args.max_tokens, keep=args.keep, node=args.node)


def _cmd_status(args: argparse.Namespace) -> int:
    from mlx_fleet.contract import Keys
    from mlx_fleet.etcd_credentials import credentials_from_args
    from mlx_fleet.fleetstatus import RouterUnavailable, collect, fetch_routing, render
    from mlx_fleet.routing.api_keys import KeyFile
    from mlx_fleet.store import EtcdStore, StoreError

    try:
        store = EtcdStore(args.etcd_endpoint, credentials=credentials_from_args(args))
        key = (KeyFile(args.router_key_file, flag="--router-key-file").first
               if args.router and args.router_key_file else None)
    except ValueError as e:  # KeyFileError is one
        print(f"error: {e}", file=sys.stderr)
        return 2
    unreachable: list[str] = []

    async def go() -> None:
        async with store:
            view = await collect(store, Keys(args.etcd_prefix))
        routing = None
        if args.router:
            try:
                routing = await fetch_routing(args.router, key=key)
            except RouterUnavailable as e:  # the etcd part still prints
                unreachable.append(str(e))
        render(view, make_console(), routing=routing)

    try:
        asyncio.run(go())
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for line in unreachable:
        print(f"error: {line}", file=sys.stderr)
    return 1 if unreachable else 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from mlx_fleet.contract import ROOT

    p = argparse.ArgumentParser(prog="mlx-fleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("provision", help="build and cache etcd, kube-apiserver, kubectl, helm, "
                                         "prometheus",
                       description="Build etcd, kube-apiserver/kubectl, helm and prometheus/promtool from "
                                   "the Go module proxy into "
                                   "$MLX_FLEET_CACHE/bin (default ~/.cache/mlx-fleet). The first build "
                                   "takes many minutes; later calls return at once.")
    s.add_argument("--print-bin-dir", action="store_true",
                   help="print the directories holding the binaries (for PATH) and nothing else")
    s.add_argument("--node", action="store_true",
                   help="also provision what `dev up --node` needs (Linux, root): Debian packages, "
                        "kubelet, kube-controller-manager, kube-scheduler, kube-proxy, the pause, "
                        "Python base and operator images")
    s.set_defaults(func=_cmd_provision)

    dev = sub.add_parser("dev", help="run a local control plane on loopback").add_subparsers(
        dest="dev_command", required=True, metavar="ACTION")
    up = dev.add_parser("up", help="start etcd + kube-apiserver (+ operator, agents) until Ctrl-C",
                        description="Start a local control plane on free loopback ports and keep it "
                                    "running until Ctrl-C or `mlx-fleet dev down`.")
    up.add_argument("--workdir", help="directory for data, PKI, logs and the kubeconfig (default: temp)")
    up.add_argument("--operator", action="store_true", help="also run the operator")
    up.add_argument("--agents", type=int, default=0, metavar="N", help="also run N node agents")
    up.add_argument("--prometheus", action="store_true",
                    help="also run Prometheus (built once from the Go module proxy) scraping the "
                         "operator, the agents and the router every 5 s; prints its URL")
    up.add_argument("--router", action="store_true",
                    help="also run the fleet router (mlx-fleet-router, every namespace): one "
                         "OpenAI endpoint for the whole fleet; prints its URL (with --operator, "
                         "each ModelDeployment's status.router shows it)")
    up.add_argument("--router-port", type=int, default=0, metavar="PORT",
                    help="the router's port (default: a free one)")
    up.add_argument("--node", action="store_true",
                    help="also run a real node (Linux, root): containerd, kubelet, kube-proxy, "
                         "controller-manager and scheduler, with the operator image built from "
                         "this repository imported, so that the chart's Pods run "
                         "(docs/development.md, \"A real node\")")
    up.add_argument("--keep", action="store_true", help="keep the working directory on exit")
    up.set_defaults(func=_cmd_dev_up)
    down = dev.add_parser("down", help="stop a running `mlx-fleet dev up`")
    down.set_defaults(func=_cmd_dev_down)

    d = sub.add_parser("demo", help="run the local demo fleet end to end",
                       description="Bring up the local control plane, the operator, two agents "
                                   "and the fleet router, apply examples/modeldeployment.yaml, wait "
                                   "until Ready, stream a chat completion through the router, run "
                                   "two canaries, a drain and a Mac's SIGKILL under load (every "
                                   "request through the router), print the fleet, tear down.")
    d.add_argument("--prompt", default="Write one sentence about Apple silicon.",
                   help="the user message sent to the model (default: %(default)r)")
    d.add_argument("--max-tokens", type=_positive_int, default=48,
                   help="completion tokens to stream, at least 1 (default: %(default)s)")
    d.add_argument("--keep", action="store_true", help="keep the logs directory after success")
    d.add_argument("--node", action="store_true",
                   help="first run the chart for real on a kubelet node added to the demo's "
                        "control plane (Linux, root; adds minutes of set-up, more on first use: "
                        "Debian packages, Go builds, the images): operator image built and "
                        "imported, helm install with the CRDs, the operator Pod Ready, a "
                        "ModelDeployment Ready through it, a completion, helm upgrade under load "
                        "(0 failed), teardown (docs/development.md, \"A real node\")")
    d.set_defaults(func=_cmd_demo)

    from mlx_fleet import testmodel

    m = sub.add_parser("make-test-model", help="write a small real MLX model to DIR")
    testmodel.add_arguments(m)
    m.set_defaults(func=testmodel.run)

    from mlx_fleet import mirror_manifest

    mm = sub.add_parser("make-manifest", help="write DIR/manifest.json (sizes and sha256) for "
                                              "an https:// model mirror")
    mirror_manifest.add_arguments(mm)
    mm.set_defaults(func=mirror_manifest.run)

    st = sub.add_parser("status", help="print nodes, assignments and reports from etcd",
                        description="Read the node records, assignments and agent reports from "
                                    "the assignments etcd and print one row per node and model.")
    st.add_argument("--etcd-endpoint", default=os.environ.get("MLX_FLEET_ETCD_ENDPOINT", "http://127.0.0.1:2379"),
                    help="etcd client URL (env MLX_FLEET_ETCD_ENDPOINT)")
    st.add_argument("--etcd-prefix", default=ROOT, help=f"key root (default {ROOT})")
    st.add_argument("--router", default=os.environ.get("MLX_FLEET_ROUTER_URL") or None,
                    metavar="URL",
                    help="a fleet router's base URL: add each Mac's circuit breaker and the "
                         "router's requests in flight to it (its GET /fleet; env "
                         "MLX_FLEET_ROUTER_URL). Unreachable: the etcd table still prints, "
                         "then one error line, exit status 1")
    st.add_argument("--router-key-file",
                    default=os.environ.get("MLX_FLEET_ROUTER_KEY_FILE") or None, metavar="FILE",
                    help="the router's API key file (its --api-key-file format; the first key "
                         "is sent) when the router has keys (env MLX_FLEET_ROUTER_KEY_FILE)")
    from mlx_fleet.etcd_credentials import add_etcd_arguments

    add_etcd_arguments(st)
    st.set_defaults(func=_cmd_status)

    from mlx_fleet import canarycli

    c = sub.add_parser("canary", help="status / promote / abort a Canary",
                       description=canarycli.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    canarycli.add_arguments(c)
    c.set_defaults(func=canarycli.run)

    from mlx_fleet import nodecli

    for action, what in (("cordon", "take no new replicas on a Mac (spec.unschedulable)"),
                         ("uncordon", "place new replicas on a Mac again")):
        n = sub.add_parser(action, help=what, description=nodecli.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        nodecli.add_arguments(n)
        n.set_defaults(func=nodecli.run)
    d = sub.add_parser("drain", help="move every replica off a Mac, then wait (spec.drain)",
                       description=nodecli.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    nodecli.add_drain_arguments(d)
    d.set_defaults(func=nodecli.run)

    from mlx_fleet import etcdcli

    e = sub.add_parser("etcd", help="etcd administration (bootstrap-auth)",
                       description=etcdcli.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    etcdcli.add_arguments(e)

    from mlx_fleet import certcli

    cs = sub.add_parser("certs", help="certificates and keys for a closed fleet (CA, per-Mac, "
                                      "API keys, etcd JWT keys)",
                        description=certcli.__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    certcli.add_arguments(cs)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
