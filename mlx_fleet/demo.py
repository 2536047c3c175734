"""The local demo fleet: control plane, operator, two agents, the fleet router, one
ModelDeployment, one streamed completion, two canaries and a drain under load, then a Mac's death
under load.

Every request goes to the fleet router (``python -m mlx_fleet_router``, one URL for the whole
fleet), never to an agent. Steps (each shown as it runs): build/cached binaries → generate the
test models (a healthy one and one whose revision fails after two tokens — the fault is in its
files) → start etcd ×2 + kube-apiserver → start the operator, agents ``mac-a``/``mac-b`` and the
router → ``kubectl apply`` ``examples/modeldeployment.yaml`` → ``kubectl wait`` for ``Ready`` →
stream a chat completion with the official ``openai`` client through the router → a JSON-schema
structured output, a forced tool call, and an embedding ModelDeployment queried on
``/v1/embeddings`` (:mod:`mlx_fleet.demo_api`) → with clients
sending requests all along: a Canary of a healthy revision v2 steps 25 % → 50 % → 100 % and is
promoted; a Canary of the faulty revision is rolled back by itself (``kubectl get canaries`` is
printed at every change) → back to one replica, ``mlx-fleet drain`` of its Mac while clients
keep sending: the replica moves to the other Mac with no failed request → uncordon, two
replicas, and one serving agent SIGKILLed while clients keep sending: no request fails (the
router retries what had not started on the other Mac) → print the fleet → tear everything down.
On failure it says which step failed and keeps the logs directory.

With ``node=True`` (``mlx-fleet demo --node``; Linux, root; minutes more set-up) the chart runs
for real first, on a kubelet node added to the same control plane: the operator image built from
the repository's Dockerfile and imported into the node's containerd → ``helm install`` of
``charts/mlx-fleet`` with its CRDs → the operator Pod Running and Ready (``kubectl get pods``) →
two agents on the host and a router for the chart's namespace → a ModelDeployment Ready through
the in-cluster operator → a completion through the router → ``helm upgrade`` with a changed
value while clients send requests (0 failed) → teardown (the ModelDeployment deleted, ``helm
uninstall``, the namespace deleted). The CRDs helm installed stay (helm never deletes ``crds/``)
and serve the rest of the demo, which runs as without the flag; the node goes at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import string
import time

import yaml
from rich.console import Console
from rich.panel import Panel

from mlx_fleet.devcluster.binaries import cache_dir, ensure_all
from mlx_fleet.devcluster.controlplane import REPO_ROOT, start_control_plane
from mlx_fleet.demo_api import api_tour
from mlx_fleet.devcluster.fleet import start_agent, start_operator, start_router
from mlx_fleet.source_policy import DEV_POLICY

EXAMPLE = REPO_ROOT / "examples" / "modeldeployment.yaml"


class DemoFailed(RuntimeError):
    pass


def _step(console: Console, text: str):
    return console.status(f"[bold]{text}…")


def run_demo(*, prompt: str = "Write one sentence about Apple silicon.", max_tokens: int = 48,
             keep: bool = False, node: bool = False, console: Console | None = None) -> int:
    """Run the demo; returns a process exit code (0 on success). ``node``: first run the chart
    on a real local node (module docstring; Linux, root)."""
    from mlx_fleet.console import make_console, progress_builder
    from mlx_fleet.testmodel import Fault, make_test_model

    console = console or make_console()
    t0 = time.monotonic()
    binaries = progress_builder(console, ensure_all)
    with _step(console, "Generating the test model (random weights, real BPE tokenizer)"):
        model_dir = make_test_model(cache_dir() / "models" / "tiny-llama")
    console.print(f"[green]✓[/] test model at {model_dir}")

    real_node = None
    if node:
        from mlx_fleet.console import print_step
        from mlx_fleet.devcluster.node import NodeFailed, claim_host

        try:
            real_node = claim_host(step=print_step(console))
        except NodeFailed as e:
            console.print(f"[red]Demo failed while preparing the host for a real node:[/] {e}")
            return 1
    try:
        # With a node, the API server listens on the node address, and helm installs the CRDs.
        with _step(console, "Starting etcd ×2 and kube-apiserver"):
            cp = start_control_plane(binaries=binaries, keep_workdir=True,
                                     install_crds=real_node is None,
                                     node_name=real_node.spec.name if real_node else "",
                                     node_address=real_node.spec.address if real_node else "")
    except BaseException:
        if real_node is not None:
            real_node.stop()
        raise
    console.print(f"[green]✓[/] control plane up: {cp.apiserver_url} (kubeconfig {cp.kubeconfig})")
    failed = True
    step = "starting the real node"
    try:
        if real_node is not None:
            _chart_on_a_real_node(console, cp, real_node, model_dir)
        step = "starting the operator"
        with _step(console, "Starting the operator, two node agents and the fleet router"):
            start_operator(cp)
            step = "starting the agents"
            agents = {
                "mac-a": start_agent(cp, "mac-a", chip="Apple M3 Max", memory="64Gi",
                                     labels={"agent.mlx-fleet.io/rack": "a"}),
                "mac-b": start_agent(cp, "mac-b", chip="Apple M4 Pro", memory="24Gi",
                                     labels={"agent.mlx-fleet.io/rack": "b"})}
            step = "starting the fleet router"
            router = start_router(cp).url
        console.print(f"[green]✓[/] operator, agents mac-a, mac-b and the fleet router running; "
                      f"every request below goes to the router: {router}/v1")
        console.print(f"  source policy (--source-policy of the operator and the agents): "
                      f"{DEV_POLICY.to_json()} — the demo's models are local directories; a "
                      "production fleet keeps the secure default or lists its own "
                      "(docs/security.md, 'Source policy')", highlight=False)

        step = "applying examples/modeldeployment.yaml"
        manifest = string.Template(EXAMPLE.read_text()).safe_substitute(MODEL_DIR=str(model_dir))
        console.print(f"$ kubectl apply -f {EXAMPLE.relative_to(REPO_ROOT)}")
        console.print(cp.kubectl("apply", "-f", "-", input=manifest).stdout.strip())

        step = "waiting for the ModelDeployment to become Ready"
        with _step(console, "Waiting for llama-demo to become Ready"):
            cp.kubectl("wait", "--for=condition=Ready", "modeldeployment/llama-demo",
                       "--timeout=240s", timeout=260)
        console.print("$ kubectl get modeldeployments")
        console.print(cp.kubectl("get", "modeldeployments").stdout.rstrip())

        obj = json.loads(cp.kubectl("get", "modeldeployment/llama-demo", "-o", "json").stdout)
        model = obj["spec"]["model"].get("servedModelName", "llama-demo")
        step = "waiting for the router to list the model"
        _wait_listed(router, model, ready=1)
        step = f"streaming a chat completion through the router {router}"
        _stream_completion(console, router, model, prompt, max_tokens)

        step = "structured outputs, a tool call and embeddings through the router"
        embed_dir = make_test_model(cache_dir() / "models" / "tiny-embed", embedding=True)
        api_tour(console, cp, router, model, embed_dir, _wait_listed)

        step = "running a canary that is promoted"
        faulty = make_test_model(cache_dir() / "models" / "tiny-llama-faulty",
                                 fault=Fault("raise", after_tokens=2))
        cp.kubectl("patch", "modeldeployment/llama-demo", "--type=merge",
                   "-p", '{"spec": {"replicas": 2}}')
        cp.kubectl("wait", "--for=jsonpath={.status.readyReplicas}=2",
                   "modeldeployment/llama-demo", "--timeout=240s", timeout=260)
        asyncio.run(_canaries(console, cp, router, model, faulty))

        step = "draining a Mac under load"
        cp.kubectl("patch", "modeldeployment/llama-demo", "--type=merge",
                   "-p", '{"spec": {"replicas": 1}}')
        cp.kubectl("wait", "--for=jsonpath={.status.replicas}=1", "modeldeployment/llama-demo",
                   "--timeout=240s", timeout=260)
        drained = asyncio.run(_drain(console, cp, router, model))

        step = "killing a serving Mac under load"
        asyncio.run(_failover(console, cp, router, model, agents, drained))

        step = "printing the fleet status"
        _print_fleet(console, cp.etcd_url)
        failed = False
        console.print(f"[bold green]Demo finished in {time.monotonic() - t0:.0f}s.[/]")
        return 0
    except Exception as e:  # the demo reports any failure and where to look
        console.print(Panel(f"[red]{type(e).__name__}: {e}[/]\n\nLogs: {cp.logs_dir}",
                            title=f"Demo failed while {step}", border_style="red"))
        return 1
    finally:
        with _step(console, "Tearing down"):
            cp.keep_workdir = keep or failed
            if real_node is not None:  # its Pods' containers first, while the API server runs
                real_node.stop()
            cp.stop()
        if cp.keep_workdir:
            console.print(f"logs kept in {cp.logs_dir}")


def _shown(console: Console, cp, *args: str) -> str:
    """``kubectl ARGS``, printed as typed and then its output; returns the output."""
    console.print("$ kubectl " + " ".join(args), markup=False, highlight=False, soft_wrap=True)
    done = cp.kubectl(*args)
    out = done.stdout.rstrip()
    # kubectl writes "No resources found ..." to stderr
    console.print(out or done.stderr.rstrip(), markup=False, highlight=False)
    return out


def _chart_on_a_real_node(console: Console, cp, node, model_dir) -> None:  # noqa: ANN001
    """The ``--node`` part (module docstring); raises on any failure."""
    from mlx_fleet.console import print_step, progress_builder
    from mlx_fleet.contract import Keys
    from mlx_fleet.devcluster.chart import (CHART, helm, local_values, start_chart_node,
                                            wait_pod)
    from mlx_fleet.devcluster.helm import ensure_helm
    from mlx_fleet.devcluster.processes import free_port

    step = print_step(console)
    console.print(Panel("A kubelet node joins this control plane; the operator image is built "
                        "from the repository's Dockerfile (no registry) and imported into its "
                        "containerd; then the chart is installed as on a real cluster",
                        title="The chart on a real node"))
    helm_exe = progress_builder(console, ensure_helm)
    started = time.monotonic()
    console.print("building the operator image (buildah; the Debian base on first use), then "
                  "starting containerd, kubelet, kube-proxy, scheduler and controller-manager")
    progress_builder(console, lambda progress: start_chart_node(cp, node, step=step,
                                                                progress=progress))
    step(f"node {cp.node_name} Ready", time.monotonic() - started)
    _shown(console, cp, "get", "nodes", "-o", "wide")

    ns = "mlx-fleet-system"
    keys = Keys("/mlx-fleet-demo-node")  # its own Macs and assignments, apart from the rest
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"  # the chart's router, on the node's network
    values = local_values(cp, node, namespace=ns, etcd_prefix=keys.root,
                          metrics_port=free_port(), health_port=free_port(),
                          router_port=router_port)
    chart = str(CHART.relative_to(REPO_ROOT))
    console.print(f"$ helm install mlx-fleet {chart} -n {ns} --create-namespace "
                  + " ".join(values), markup=False, highlight=False, soft_wrap=True)
    started = time.monotonic()
    with _step(console, "helm install, then waiting for the operator Pod to be Running and Ready"):
        console.print(helm(cp, helm_exe, ns, "install", "mlx-fleet", chart, "--create-namespace",
                           *values).rstrip(), markup=False, highlight=False)
        pod = wait_pod(cp, ns)
        wait_pod(cp, ns, component="router")
        for crd in sorted((CHART / "crds").glob("*.yaml")):  # installed by helm from crds/
            cp.kubectl("wait", "--for=condition=Established", "-f", str(crd), "--timeout=60s")
    step("helm install → operator and router Pods Ready", time.monotonic() - started)
    _shown(console, cp, "get", "crds")
    _shown(console, cp, "get", "pods", "-n", ns, "-o", "wide")
    security = pod["spec"]["containers"][0].get("securityContext", {})
    console.print(f"  runAsNonRoot={pod['spec'].get('securityContext', {}).get('runAsNonRoot')} "
                  f"readOnlyRootFilesystem={security.get('readOnlyRootFilesystem')} "
                  f"capabilities={security.get('capabilities')}", highlight=False)

    with _step(console, "Starting two agents on the host"):
        agents = [start_agent(cp, f"node-mac-{i}", etcd_prefix=keys.root, memory="64Gi")
                  for i in range(2)]
    console.print(f"[green]✓[/] agents node-mac-0, node-mac-1; the chart's router: {router_url}/v1")

    name = "llama-node"
    obj = yaml.safe_load(string.Template(EXAMPLE.read_text()).safe_substitute(
        MODEL_DIR=str(model_dir)))
    obj["metadata"] = {"name": name, "namespace": ns}
    obj["spec"]["model"]["servedModelName"] = name
    obj["spec"]["replicas"] = 2
    console.print(f"$ kubectl apply -f - -n {ns}   # {EXAMPLE.relative_to(REPO_ROOT)}, renamed, "
                  "2 replicas", markup=False, highlight=False)
    console.print(cp.kubectl("apply", "-f", "-", input=json.dumps(obj)).stdout.strip())
    started = time.monotonic()
    with _step(console, f"Waiting for {name} to become Ready through the in-cluster operator"):
        cp.kubectl("wait", "--for=condition=Ready", f"modeldeployment/{name}", "-n", ns,
                   "--timeout=240s", timeout=260)
    step(f"{name} Ready", time.monotonic() - started)
    _shown(console, cp, "get", "modeldeployments", "-n", ns)
    _wait_listed(router_url, name, ready=2)
    _complete_once(console, router_url, name)

    old_uid = pod["metadata"]["uid"]
    console.print(Panel("helm upgrade with a changed value (operator.verbose=true) while 8 "
                        "clients send requests to the router: the operator Pod is replaced; "
                        "the agents keep serving", title="helm upgrade under load"))
    console.print(f"$ helm upgrade mlx-fleet {chart} -n {ns} ... --set operator.verbose=true",
                  markup=False, highlight=False)
    started = time.monotonic()
    load, new_pod = asyncio.run(_under_load(router_url, name, lambda: (
        helm(cp, helm_exe, ns, "upgrade", "mlx-fleet", chart, *values,
             "--set", "operator.verbose=true"),
        wait_pod(cp, ns, not_uid=old_uid))[1]))
    step("helm upgrade → new operator Pod Ready", time.monotonic() - started)
    _shown(console, cp, "get", "pods", "-n", ns)
    failed = [o for o in load.outcomes if o.failed]
    console.print(f"[green]✓[/] operator Pod {pod['metadata']['name']} → "
                  f"{new_pod['metadata']['name']} (args "
                  f"{' '.join(new_pod['spec']['containers'][0].get('args', []))}): "
                  f"{len(load.outcomes)} requests during the upgrade, [bold]{len(failed)} "
                  "failed[/]", highlight=False)
    _print_failures(console, failed)
    if failed or not load.outcomes:
        raise DemoFailed(f"{len(failed)} of {len(load.outcomes)} requests failed during helm upgrade")

    started = time.monotonic()
    with _step(console, "Tearing the chart down"):
        console.print(f"$ kubectl delete modeldeployment {name} -n {ns}", markup=False)
        cp.kubectl("delete", "modeldeployment", name, "-n", ns, "--timeout=120s", timeout=130)
        console.print(f"$ helm uninstall mlx-fleet -n {ns} --wait", markup=False)
        console.print(helm(cp, helm_exe, ns, "uninstall", "mlx-fleet", "--wait").rstrip(),
                      markup=False, highlight=False)
        for agent in agents:
            agent.process.stop()
        # The in-cluster operator mirrored its agents as (cluster-scoped) MacNodes; it is gone.
        macs = [a.name for a in agents]
        console.print(f"$ kubectl delete namespace {ns}; kubectl delete macnodes {' '.join(macs)}",
                      markup=False)
        cp.kubectl("delete", "namespace", ns, "--timeout=120s", timeout=130)
        cp.kubectl("delete", "macnodes", *macs, "--ignore-not-found", "--timeout=60s", timeout=70)
    step("chart torn down (the CRDs stay: helm never deletes crds/)", time.monotonic() - started)
    _shown(console, cp, "get", "pods,modeldeployments,macnodes", "-A")


def _complete_once(console: Console, router: str, model: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{router}/v1", api_key="not-needed")
    done = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=8)
    console.print(f"[green]✓[/] completion through the router from {model}: "
                  f"{done.usage.completion_tokens} tokens "
                  f"{done.choices[0].message.content!r}", highlight=False)


async def _under_load(router: str, model: str, action):  # noqa: ANN001, ANN202
    """Run the blocking ``action`` in a thread while 8 clients send requests to ``router``;
    returns (the LoadGenerator, ``action``'s value)."""
    from mlx_fleet.devcluster.loadgen import LoadGenerator

    async with LoadGenerator(lambda: [router], model,
                             sessions=[f"upgrade-{i}" for i in range(8)]) as load:
        await load.wait_for(8)
        value = await asyncio.to_thread(action)
        await load.wait_for(8)  # and some after the new Pod is Ready
    return load, value


def _stream_completion(console: Console, base_url: str, model: str, prompt: str, max_tokens: int) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="not-needed")
    console.print(Panel(prompt, title=f"prompt → {model} at {base_url}"))
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0.8, stream=True, stream_options={"include_usage": True})
    t0 = time.monotonic()
    ttft = None
    usage = None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta and choice.delta.content:
                if ttft is None:
                    ttft = time.monotonic() - t0
                console.print(choice.delta.content, end="", markup=False, highlight=False)
    console.print()
    console.print(f"[dim](random weights: the text is noise; TTFT {1000 * (ttft or 0):.0f} ms"
                  + (f", {usage.completion_tokens} tokens" if usage else "") + ")[/]")


def _canary(name: str, revision: str, steps: list[int], source: str | None = None) -> str:
    candidate = {"revision": revision} | ({"source": source} if source else {})
    return json.dumps({
        "apiVersion": "mlx-fleet.io/v1alpha1", "kind": "Canary",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"targetRef": {"name": "llama-demo"}, "candidate": candidate,
                 "steps": [{"setWeight": w} for w in steps],
                 # Short windows for a demo. Two revisions sharing two CPU cores differ in p95
                 # latency by scheduling jitter alone, so latency is judged by absolute limits
                 # here (on Macs, the default relative rules: 1.5 × stable); the decode rate
                 # too (measured: a healthy v2 at 0.61 × stable in one 2 s window, the Mac
                 # holding both revisions runs two batches), so its floor is 0.3 × stable here
                 # (default 0.67).
                 "analysis": {"interval": "2s", "minRequests": 3,
                              "checks": {"latencyP95": {"maxSeconds": 5},
                                         "ttftP95": {"maxSeconds": 5},
                                         "tokensPerSecond": {"minRatio": 0.3}}}}})


async def _follow(console: Console, cp, name: str, until: set[str], timeout: float = 240) -> dict:
    """Stream ``kubectl get canary NAME -w`` (one row per change of the printed columns) until
    the phase is one of ``until``; returns the object."""
    proc = await asyncio.create_subprocess_exec(
        str(cp.binaries.kubectl), "get", "canary", name, "-w", "--no-headers",
        env={**os.environ, **cp.env()}, stdout=asyncio.subprocess.PIPE)
    shown = ""

    async def rows() -> None:
        nonlocal shown
        assert proc.stdout is not None
        async for raw in proc.stdout:
            row = " ".join(raw.decode().split()[:-1])  # without AGE, which always changes
            if row != shown:
                console.print(f"  {time.strftime('%H:%M:%S')}  {raw.decode().rstrip()}",
                              markup=False, highlight=False)
                shown = row
            if any(f" {phase}" in row for phase in until):
                return

    try:
        await asyncio.wait_for(rows(), timeout)
    except asyncio.TimeoutError:
        raise DemoFailed(f"canary {name} did not reach {sorted(until)} in {timeout:.0f}s") from None
    finally:
        proc.terminate()
        await proc.wait()
    return json.loads(cp.kubectl("get", "canary", name, "-o", "json").stdout)


def _listed(router: str, model: str) -> dict:
    """The router's ``GET /v1/models`` entry for ``model`` (``{}`` when it lists none)."""
    import urllib.request

    with urllib.request.urlopen(f"{router}/v1/models", timeout=5) as r:
        return {m["id"]: m for m in json.load(r)["data"]}.get(model, {})


def _wait_listed(router: str, model: str, *, ready: int, timeout: float = 60) -> None:
    """Until the router lists ``model`` with ``ready`` Ready replicas (it follows etcd, so
    it sees a replica shortly after the operator does)."""
    deadline = time.monotonic() + timeout
    while _listed(router, model).get("ready_replicas") != ready:
        if time.monotonic() > deadline:
            raise DemoFailed(f"the router did not list {model} with {ready} Ready replicas in "
                             f"{timeout:.0f}s: {_listed(router, model)}")
        time.sleep(0.1)


async def _canaries(console: Console, cp, router: str, model: str, faulty) -> None:
    from mlx_fleet.devcluster.loadgen import LoadGenerator
    from mlx_fleet.routing.split import bucket

    await asyncio.to_thread(_wait_listed, router, model, ready=2)
    sessions = [f"demo-user-{i}" for i in range(16)]
    async with LoadGenerator(lambda: [router], model, sessions=sessions) as load:
        await load.wait_for(len(sessions))
        console.print(Panel("A healthy revision v2, stepped 25% → 50% → 100% while 16 clients "
                            "send requests to the router, which splits them by session "
                            "(the agents' bucket hash); each step waits for one passing "
                            "analysis window (candidate vs stable)", title="Canary 1: promote"))
        cp.kubectl("apply", "-f", "-", input=_canary("llama-demo-v2", "v2", [25, 50, 100]))
        console.print("$ kubectl get canaries -w")
        await _follow(console, cp, "llama-demo-v2", {"Succeeded", "RolledBack", "Failed"})
        revision = json.loads(cp.kubectl("get", "modeldeployment/llama-demo", "-o", "json")
                              .stdout)["spec"]["model"]["revision"]
        console.print(f"[green]✓[/] promoted: llama-demo now serves revision {revision}")

        console.print(Panel("Revision v3 raises after two tokens (the fault is in its model "
                            "files). The agents' local guard and the operator's analysis roll "
                            "it back by themselves", title="Canary 2: roll back"))
        before = len(load.outcomes)
        cp.kubectl("apply", "-f", "-", input=_canary("llama-demo-v3", "v3", [50, 100],
                                                     str(faulty)))
        obj = await _follow(console, cp, "llama-demo-v3", {"RolledBack", "Succeeded", "Failed"})
        await load.wait_for(len(sessions))
    out = load.outcomes[before:]
    stable_side = {s for s in sessions if bucket("default/llama-demo", s) >= 50 * 100}
    console.print(f"[green]✓[/] {obj['status'].get('message', '')}")
    console.print(f"  requests during canary 2: {len(out)}; failed on the faulty revision: "
                  f"{sum(o.failed and o.revision == 'v3' for o in out)}; failed on sessions "
                  f"hashed to the stable revision: "
                  f"{sum(o.failed for o in out if o.session in stable_side)}")
    console.print("$ kubectl get canaries")
    console.print(cp.kubectl("get", "canaries").stdout.rstrip())


async def _drain(console: Console, cp, router: str, model: str) -> str:
    """``mlx-fleet drain`` of the Mac serving the one replica, while clients send requests to
    the router; returns the drained Mac's name."""
    import sys

    from mlx_fleet.devcluster.loadgen import LoadGenerator

    md = json.loads(cp.kubectl("get", "modeldeployment/llama-demo", "-o", "json").stdout)
    node = md["status"]["nodes"][0]["name"]
    console.print(Panel(f"{node} is drained while 8 clients send requests to the router: its "
                        "replica is placed on the other Mac first, serves until that one is "
                        "Ready, then leaves the routing table, finishes its requests and "
                        "unloads", title="Drain a Mac"))
    console.print(f"$ mlx-fleet drain {node}")
    async with LoadGenerator(lambda: [router], model,
                             sessions=[f"drain-{i}" for i in range(8)]) as load:
        await load.wait_for(8)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "mlx_fleet.cli", "drain", node, "--timeout", "120",
            env={**os.environ, **cp.env()}, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        assert proc.stdout is not None
        async for line in proc.stdout:
            console.print(f"  {line.decode().rstrip()}", markup=False, highlight=False)
        if await proc.wait() != 0:
            raise DemoFailed(f"mlx-fleet drain {node} failed")
        await load.wait_for(8)
    out = load.outcomes
    console.print(f"[green]✓[/] {node} drained: {len(out)} requests during the drain, "
                  f"{sum(o.failed for o in out)} failed")
    _print_failures(console, out)
    console.print("$ kubectl get macnodes")
    console.print(cp.kubectl("get", "macnodes").stdout.rstrip())
    return node


async def _failover(console: Console, cp, router: str, model: str, agents: dict,
                    drained: str) -> None:
    """Uncordon the ``drained`` Mac, two replicas again, then SIGKILL one serving agent while
    clients send requests to the router: non-streamed requests and streams that had not begun
    are retried on the other Mac (none fails); a stream already running on the killed Mac is
    cut (counted; resuming it elsewhere is later work)."""
    from mlx_fleet.devcluster.loadgen import LoadGenerator

    import subprocess
    import sys

    console.print(f"$ mlx-fleet uncordon {drained}")
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "mlx_fleet.cli", "uncordon", drained],
        env={**os.environ, **cp.env()}, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise DemoFailed(f"mlx-fleet uncordon {drained} failed: {done.stderr.strip()}")
    console.print(f"  {done.stdout.strip()}", markup=False, highlight=False)
    console.print("$ kubectl patch modeldeployment/llama-demo --type=merge "
                  "-p '{\"spec\": {\"replicas\": 2}}'")
    cp.kubectl("patch", "modeldeployment/llama-demo", "--type=merge",
               "-p", '{"spec": {"replicas": 2}}')
    await asyncio.to_thread(
        cp.kubectl, "wait", "--for=jsonpath={.status.readyReplicas}=2",
        "modeldeployment/llama-demo", "--timeout=240s", timeout=260)
    await asyncio.to_thread(_wait_listed, router, model, ready=2)
    victim = json.loads(cp.kubectl("get", "modeldeployment/llama-demo", "-o", "json").stdout
                        )["status"]["nodes"][0]["name"]
    console.print(Panel(f"Two replicas; {victim}'s agent is SIGKILLed (no goodbye: its lease "
                        "just stops) while 8 clients send plain requests and 4 stream, all "
                        "through the router", title="Kill a Mac"))
    async with LoadGenerator(lambda: [router], model, stream=False,
                             sessions=[f"kill-{i}" for i in range(8)]) as plain, \
            LoadGenerator(lambda: [router], model,
                          sessions=[f"kill-stream-{i}" for i in range(4)]) as streams:
        await plain.wait_for(16)
        console.print(f"$ kill -9 {agents[victim].process.pid}   # agent {victim}")
        agents[victim].process.kill()
        killed = time.monotonic()
        await plain.wait_for(40)
        await streams.wait_for(8)
    after = [o for o in plain.outcomes + streams.outcomes if o.ended >= killed]
    # A stream whose 200 had come (the router sent its first byte: nothing is retried after
    # that) and that then broke off ran on the killed Mac: cut, not failed.
    cut = [o for o in streams.outcomes if o.failed and o.status == 200
           and o.error_kind in ("connection", "incomplete")]
    failed = [o for o in plain.outcomes + streams.outcomes if o.failed and o not in cut]
    console.print(f"[green]✓[/] {victim} killed: {len(plain.outcomes)} plain requests and "
                  f"{len(streams.outcomes)} streams through the router ({len(after)} ended "
                  f"after the kill), [bold]{len(failed)} failed[/] (plain "
                  f"{sum(o.failed for o in plain.outcomes)}); streams cut mid-answer on "
                  f"{victim}: {len(cut)}")
    _print_failures(console, failed)
    console.print(f"[dim]  {victim} stays in etcd (the table below) until its lease TTL runs out; "
                  "the router stopped sending to it at its first refused connection[/]")
    if failed:
        raise DemoFailed(f"{len(failed)} requests failed through the router after {victim} "
                         "was killed")


def _print_failures(console: Console, outcomes) -> None:
    """The first few failures' reasons, if any."""
    for o in [o for o in outcomes if o.failed][:3]:
        console.print(f"  [red]failed[/] ({o.error_kind}): {o.error}", highlight=False)


def _print_fleet(console: Console, etcd_url: str) -> None:
    from mlx_fleet.contract import Keys
    from mlx_fleet.fleetstatus import collect, render
    from mlx_fleet.store import EtcdStore

    async def go() -> None:
        async with EtcdStore(etcd_url) as store:
            render(await collect(store, Keys()), console)

    asyncio.run(go())
