"""The node agent's command line: its flags, their types and checks, and the
:class:`AgentConfig` they become (``mlx-fleet-agent --help``). One job: turning ``argv`` into a
checked configuration; :mod:`node_agent.main` runs the agent with it.

Errors: a malformed flag value exits 2 through argparse with one line naming the flag;
:func:`config_from_args` raises ``ValueError`` (one line) for flags that contradict each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket

from mlx_fleet.contract import IDLE_STATS_INTERVAL_SECONDS, ROOT, WATERMARK, check_watermark
from mlx_fleet.etcd_credentials import EtcdCredentials, add_etcd_arguments, credentials_from_args
from mlx_fleet.exposure import (INSECURE_ETCD, INSECURE_FORWARD, INSECURE_HTTP_LISTEN,
                                INSECURE_LISTEN, add_insecure_arguments, exposure_check,
                                is_loopback)
from mlx_fleet.http_hygiene import (HttpLimits, add_http_arguments, add_metrics_auth_argument,
                                   add_tls_arguments, check_tls_arguments,
                                   http_limits_from_args, metrics_auth)
from mlx_fleet.source_policy import DEFAULT_POLICY, SourcePolicy
from mlx_fleet.source_policy_file import ENV_SOURCE_POLICY, load_policy
from mlx_fleet.store import check_endpoint, parse_endpoint

from mlx_fleet.quantity import parse_quantity, positive_quantity
from .fetch.bounds import DEFAULT_UNUSED_MAX_AGE_S, DownloadLimits, parse_reserve
from .lifecycle import DEFAULT_MAX_PREFETCHES, DEFAULT_PREFETCH_WINDOW_SECONDS
from .registration import DEFAULT_LEASE_TTL
from .serving.admission import POLICIES
from .serving.core import DEFAULT_MAX_CHOICES
from .serving.options import ServingOptions
from .serving.tokenize import DEFAULT_MAX_PROMPT_BYTES

__all__ = ["AgentConfig", "StartupError", "build_parser", "config_from_args",
           "add_serving_arguments", "serving_options_from_args", "agent_version"]

ENV_ETCD_ENDPOINT = "MLX_FLEET_ETCD_ENDPOINT"
DEFAULT_ETCD_ENDPOINT = "http://127.0.0.1:2379"
DEFAULT_LISTEN = "127.0.0.1:8000"


def agent_version() -> str:
    try:
        from importlib.metadata import version
        return version("mlx-fleet")
    except Exception:  # running from a source tree without metadata
        return ""


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) → ``(host, port)``; port 0 picks a free port.
    Raises ``ValueError``."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    p = int(port)
    if not 0 <= p <= 65535:
        raise ValueError(f"port out of range in {text!r}")
    return host, p


def parse_label(text: str) -> tuple[str, str]:
    """``key=value`` → ``(key, value)``; raises ``ValueError`` for a missing ``=`` or key."""
    k, sep, v = text.partition("=")
    if not sep or not k.strip():
        raise ValueError(f"expected key=value, got {text!r}")
    return k.strip(), v.strip()


def whole_number(text: str, minimum: int) -> int:
    """``text`` as a whole number ≥ ``minimum``; raises ``ValueError`` saying which."""
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"expected a whole number, got {text!r}") from None
    if n < minimum:
        raise ValueError(f"must be at least {minimum}, got {n}")
    return n


def positive_int(text: str) -> int:
    """A whole number ≥ 1 (``--lease-ttl``, ``--max-queued-requests``); raises ``ValueError``."""
    return whole_number(text, 1)


def non_negative_int(text: str) -> int:
    """A whole number ≥ 0 (``--max-prefetches``, ``--max-loaded-models``); raises
    ``ValueError``."""
    return whole_number(text, 0)


def non_negative_seconds(text: str) -> float:
    """A finite number of seconds ≥ 0 (``--prefetch-window-seconds``); raises ``ValueError``."""
    try:
        x = float(text)
    except ValueError:
        raise ValueError(f"expected a number of seconds, got {text!r}") from None
    if not (x >= 0 and x != float("inf")):
        raise ValueError(f"must be a finite number >= 0, got {text!r}")
    return x


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (``--stats-interval-seconds``); raises ``ValueError``."""
    x = non_negative_seconds(text)
    if x == 0:
        raise ValueError(f"must be more than 0, got {text!r}")
    return x


def memory_watermark(text: str) -> float:
    """``--memory-watermark``: a fraction in (0, 1] (``0.8`` for 80 %), checked by
    :func:`mlx_fleet.contract.check_watermark`; raises ``ValueError``."""
    try:
        x = float(text)
    except ValueError:
        raise ValueError(f"expected a fraction in (0, 1] such as 0.8, got {text!r}") from None
    try:
        return check_watermark(x)
    except ValueError:
        raise ValueError(f"must be a fraction in (0, 1] such as 0.8, got {text!r}") from None


def etcd_endpoint(text: str) -> str:
    """An etcd client URL the store accepts (``http://host:port``); raises ``ValueError``."""
    parse_endpoint(text)
    return text


def _argtype(fn):
    def wrapped(text: str):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    wrapped.__name__ = fn.__name__
    return wrapped


def memory_quantity(text: str) -> int:
    """``--simulated-memory``: a Kubernetes quantity (:func:`mlx_fleet.quantity.parse_quantity`)
    of at least one byte."""
    n = parse_quantity(text)
    if n <= 0:
        raise ValueError(f"memory must be greater than zero, got {text!r}")
    return n


def prompt_cache_bytes(text: str) -> int:
    """``--prompt-cache-bytes``: a Kubernetes quantity (:func:`mlx_fleet.quantity.parse_quantity`)
    of at least 0 bytes (0: nothing stays cached beyond the live batch)."""
    n = parse_quantity(text)
    if n < 0:
        raise ValueError(f"must be at least 0 bytes, got {text!r}")
    return n


def add_serving_arguments(p: argparse.ArgumentParser) -> None:
    """The serving options' flags (:class:`~node_agent.serving.options.ServingOptions`):
    ``--prompt-cache``/``--no-prompt-cache``, ``--prompt-cache-bytes``, ``--admission-policy``,
    ``--stream-buffer-chunks``, ``--coalesce-requests``, ``--fast-first-token``,
    ``--prefill-batch-tokens``.
    ``benchmarks/serving.py`` adds them too, to serve with the agent's very flags."""
    d = ServingOptions()
    p.add_argument("--prompt-cache", action=argparse.BooleanOptionalAction,
                   default=d.prompt_cache,
                   help="reuse the KV cache of prompt prefixes across requests (mlx-lm's "
                        "LRUPromptCache, one per model revision); --no-prompt-cache turns it "
                        "off (default: on)")
    p.add_argument("--prompt-cache-bytes", type=_argtype(prompt_cache_bytes), default=None,
                   metavar="QUANTITY",
                   help="each revision's byte budget for its prompt cache and its running "
                        "batch's KV cache together, a Kubernetes quantity (e.g. 2Gi); the cache "
                        "is trimmed, least recently used first, to the budget minus the live "
                        "batch (default: the revision's KV reservation, KV bytes per token x "
                        "maxContextTokens x maxConcurrentSequences)")
    p.add_argument("--admission-policy", choices=POLICIES, default=d.admission_policy,
                   help="what bounds the requests waiting for a batch slot: 'count' "
                        "(--max-queued-requests only) or 'kv' (also the estimated KV cache of "
                        "each revision's running and waiting requests, at most twice its KV "
                        "reservation) (default: %(default)s)")
    p.add_argument("--stream-buffer-chunks", type=_argtype(positive_int),
                   default=d.stream_buffer_chunks, metavar="N",
                   help="generated chunks a stream may have waiting for its client; a client "
                        "reading slower is cut off with an error event (code "
                        "stream_buffer_overflow) and its sequence leaves the batch, so it never "
                        "slows the others (at least 1; default: %(default)s)")
    p.add_argument("--coalesce-requests", action=argparse.BooleanOptionalAction,
                   default=d.request_coalescing,
                   help="identical concurrent requests (same model, revision, prompt and "
                        "sampling parameters) whose output is deterministic (temperature 0, or "
                        "a seed) share one generation, streamed to each from its first token "
                        "(default: on; --no-coalesce-requests turns it off)")
    p.add_argument("--fast-first-token", action=argparse.BooleanOptionalAction,
                   default=d.fast_first_token,
                   help="a request that finds its model's batch empty gets its first token from "
                        "one forward pass before it joins the batch: lower time to first token "
                        "(default: on; --no-fast-first-token turns it off)")
    p.add_argument("--prefill-batch-tokens", type=_argtype(non_negative_int),
                   default=d.prefill_batch_tokens, metavar="N",
                   help="padded prompt tokens one prefill pass may feed: prompts waiting for a "
                        "batch slot are prefilled together as far as they fit, so a burst of "
                        "short prompts shares one pass instead of one pass per 8 (0: mlx-lm's "
                        "fixed groups of 8 prompts; below 2048 long prompts may go one per "
                        "pass; default: %(default)s, the largest pass mlx-lm's defaults make, "
                        "8 x 2048)")


def model_cache_reserve(text: str) -> tuple[int, float]:
    """``--model-cache-reserve``: ``10%`` of the disk, or a Kubernetes quantity (``20Gi``);
    raises ``ValueError``."""
    return parse_reserve(text, parse_quantity)


def non_negative_quantity(text: str) -> int:
    """A Kubernetes quantity of at least 0 (``--model-cache-max-bytes``, 0 = no cap)."""
    n = parse_quantity(text)
    if n < 0:
        raise ValueError(f"must be at least 0, got {text!r}")
    return n


def add_download_arguments(p: argparse.ArgumentParser) -> None:
    """The model downloads' bounds and cache flags (:class:`~node_agent.fetch.DownloadLimits`)."""
    g = p.add_argument_group("model downloads and their cache (docs/node-agent.md, 'Model "
                             "sources and the download cache')")
    g.add_argument("--model-cache-reserve", type=_argtype(model_cache_reserve), default="10%",
                   metavar="PERCENT|QUANTITY",
                   help="free space a download must leave on the model cache's disk: a "
                        "percentage of the disk (10%%) or a quantity (20Gi); a download that "
                        "would go below it is refused InsufficientDisk before its first byte, "
                        "after the cache's garbage collection (default: 10%%, the kubelet's "
                        "nodefs.available<10%% hard-eviction threshold)")
    g.add_argument("--model-cache-max-bytes", type=_argtype(non_negative_quantity), default=0,
                   metavar="QUANTITY",
                   help="most bytes the agent's downloads ($MLX_FLEET_CACHE/models/https/ and "
                        "its own Hugging Face cache $MLX_FLEET_CACHE/models/hf/, unless "
                        "HF_HUB_CACHE names another) may hold (e.g. 200Gi); a download beyond it "
                        "is refused InsufficientDisk once sources no longer assigned are deleted "
                        "(default: 0, no cap)")
    g.add_argument("--model-cache-unused-seconds", type=_argtype(non_negative_seconds),
                   default=DEFAULT_UNUSED_MAX_AGE_S, metavar="SECONDS",
                   help="how long a downloaded source no longer assigned to this Mac stays in "
                        "the cache (a re-assignment or rollback reuses it) before it is "
                        "deleted; sooner when a download needs the space (default: %(default)s)")
    g.add_argument("--allow-unpinned-hub-revisions", action="store_true",
                   help="accept hf:// sources without a 40-hex commit (hf://org/repo, "
                        "hf://org/repo@main): huggingface_hub resolves the branch or tag to a "
                        "commit once and downloads every file at it, and that commit is "
                        "reported per replica; without this flag such sources fail "
                        "InvalidSource, as two Macs could hold different weights")


def download_limits_from_args(args: argparse.Namespace) -> DownloadLimits:
    """The :class:`~node_agent.fetch.DownloadLimits` of :func:`add_download_arguments`."""
    reserve_bytes, reserve_fraction = args.model_cache_reserve  # a string default is typed too
    return DownloadLimits(reserve_bytes=reserve_bytes, reserve_fraction=reserve_fraction,
                          cache_max_bytes=args.model_cache_max_bytes,
                          allow_unpinned_hub=args.allow_unpinned_hub_revisions,
                          unused_max_age_s=args.model_cache_unused_seconds)


def serving_options_from_args(args: argparse.Namespace) -> ServingOptions:
    """The :class:`~node_agent.serving.options.ServingOptions` of :func:`add_serving_arguments`'
    parsed flags."""
    return ServingOptions(prompt_cache=args.prompt_cache,
                          prompt_cache_bytes=args.prompt_cache_bytes,
                          admission_policy=args.admission_policy,
                          stream_buffer_chunks=args.stream_buffer_chunks,
                          request_coalescing=args.coalesce_requests,
                          fast_first_token=args.fast_first_token,
                          prefill_batch_tokens=args.prefill_batch_tokens)


class StartupError(Exception):
    """The agent cannot start for a reason the operator of the Mac must fix (e.g. its
    ``--listen`` address is taken); :func:`main` prints it as one line and exits 2."""


@dataclasses.dataclass
class AgentConfig:
    """Everything the agent is configured with (the CLI flags, parsed)."""

    node_name: str
    etcd_endpoint: str = DEFAULT_ETCD_ENDPOINT
    etcd_prefix: str = ROOT
    etcd_credentials: EtcdCredentials | None = None  # TLS / auth (docs/security.md)
    listen_host: str = "127.0.0.1"
    listen_port: int = 8000
    advertise_url: str | None = None
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    lease_ttl: int = DEFAULT_LEASE_TTL
    simulated_chip: str | None = None
    simulated_memory_bytes: int | None = None
    max_queued_requests: int = 64
    prefetch_window_seconds: float = DEFAULT_PREFETCH_WINDOW_SECONDS
    max_prefetches: int = DEFAULT_MAX_PREFETCHES
    stats_interval_seconds: float = IDLE_STATS_INTERVAL_SECONDS
    max_loaded_models: int = 0  # 0 = no limit but memory (see --max-loaded-models)
    memory_watermark: float = WATERMARK  # share of unified memory models may take
    api_key_file: str | None = None  # client keys; None: the API is open
    forward_key_file: str | None = None  # fleet-internal key(s) for forwarded requests
    metrics_auth: str = "open"  # "open" or "api-key"
    tls_cert_file: str | None = None  # HTTPS when set (with tls_key_file)
    tls_key_file: str | None = None
    forward_ca_file: str | None = None  # CA bundle to verify https:// nodes when forwarding
    # the --insecure-… flags given (mlx_fleet.exposure): each accepts one exposed setting
    insecure: frozenset[str] = frozenset()
    http: HttpLimits = dataclasses.field(default_factory=HttpLimits)  # timeouts, cap, CORS, Host
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES  # refused before tokenizing (400)
    max_choices: int = DEFAULT_MAX_CHOICES  # largest n per request (400 above)
    serving: ServingOptions = dataclasses.field(default_factory=ServingOptions)
    # disk reserve, cache cap, pinned hf:// commits, the cache's garbage collection
    downloads: DownloadLimits = dataclasses.field(default_factory=DownloadLimits)
    #: which model sources this Mac loads (--source-policy; default: the secure policy)
    source_policy: SourcePolicy = DEFAULT_POLICY


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx-fleet-agent",
        description="mlx-fleet node agent: registers this Mac in etcd under a lease, watches its "
                    "model assignments, serves the models with MLX over an OpenAI-compatible "
                    "HTTP API and reports per-assignment state back to etcd.")
    p.add_argument("--node-name", default=socket.gethostname(),
                   help="name of this node in etcd (nodes/<name>); must not contain '/' (default: this host's name, %(default)s)")
    p.add_argument("--etcd-endpoint", type=_argtype(etcd_endpoint),
                   default=os.environ.get(ENV_ETCD_ENDPOINT, DEFAULT_ETCD_ENDPOINT),
                   help=f"etcd client URL http://host:port or https://host:port (with "
                        f"--etcd-ca-file) (default: env {ENV_ETCD_ENDPOINT}, else "
                        f"{DEFAULT_ETCD_ENDPOINT})")
    p.add_argument("--etcd-prefix", default=ROOT,
                   help="key root of the etcd contract; must match the operator's (default: %(default)s)")
    p.add_argument("--listen", default=DEFAULT_LISTEN, type=_argtype(parse_listen),
                   metavar="HOST:PORT",
                   help="address of the OpenAI-compatible API, /health and /metrics "
                        "(default: %s; port 0 picks a free port)" % DEFAULT_LISTEN)
    p.add_argument("--advertise-url", default=None, metavar="URL",
                   help="base URL clients and the operator use to reach this agent "
                        "(default: http://<listen>, https:// with --tls-cert-file, with the host "
                        "name for 0.0.0.0/::)")
    p.add_argument("--label", action="append", default=[], type=_argtype(parse_label),
                   metavar="KEY=VALUE",
                   help="node label matched by deployments' node selectors (repeatable); "
                        "placement believes only keys under agent.mlx-fleet.io/ from an agent "
                        "(e.g. agent.mlx-fleet.io/rack=a): label the MacNode for others "
                        "(kubectl label macnode NODE KEY=VALUE)")
    p.add_argument("--lease-ttl", type=_argtype(positive_int), default=DEFAULT_LEASE_TTL,
                   metavar="SECONDS",
                   help="etcd lease TTL: a node that stops heart-beating disappears after this "
                        "long (at least 1); keep-alives are sent every TTL/3 "
                        "(default: %(default)s)")
    p.add_argument("--simulated-chip", default=None, metavar="BRAND",
                   help="pretend to be this chip, e.g. 'Apple M3 Max' (forces simulated "
                        "capacity; off macOS capacity is always simulated, default "
                        "'Apple M3 Max')")
    p.add_argument("--simulated-memory", default=None, type=_argtype(memory_quantity),
                   metavar="QUANTITY",
                   help="pretend to have this much unified memory, e.g. 64Gi (forces simulated "
                        "capacity; default off macOS: the host's physical memory)")
    p.add_argument("--max-queued-requests", type=_argtype(positive_int), default=64,
                   metavar="N",
                   help="requests waiting for a batch slot, across all models, before the API "
                        "answers 429 with Retry-After (at least 1; default: %(default)s)")
    add_serving_arguments(p)
    p.add_argument("--max-prompt-bytes", type=_argtype(positive_quantity),
                   default=DEFAULT_MAX_PROMPT_BYTES, metavar="QUANTITY",
                   help="largest prompt (UTF-8 bytes of the prompt, or of the messages' roles "
                        "and contents) the agent tokenizes, a Kubernetes quantity; a larger one "
                        "is answered 400 prompt_too_large before any tokenizing (default: 1Mi)")
    p.add_argument("--max-choices", type=_argtype(positive_int), default=DEFAULT_MAX_CHOICES,
                   metavar="N",
                   help="largest n (choices) one completion request may ask for; each choice "
                        "is a sequence of its own in the model's batch, so n is also bounded by "
                        "the model's maxConcurrentSequences; above either: 400 naming n "
                        "(default: %(default)s)")
    add_http_arguments(p, own_hosts="the --listen and --advertise-url hosts")
    add_download_arguments(p)
    p.add_argument("--prefetch-window-seconds", type=_argtype(non_negative_seconds),
                   default=DEFAULT_PREFETCH_WINDOW_SECONDS, metavar="SECONDS",
                   help="predictive prefetch: reload a standby (idle-unloaded or evicted) model "
                        "whose requests arrive periodically when its next request is expected "
                        "within this many seconds (default: %(default)s, seed 001 "
                        "prefetch_window_sec)")
    p.add_argument("--max-prefetches", type=_argtype(non_negative_int),
                   default=DEFAULT_MAX_PREFETCHES, metavar="N",
                   help="predictive prefetch: most reloads ahead of a predicted request running "
                        "at once on this node (0 turns it off; default: %(default)s, seed 001 "
                        "max_prefetch_per_gpu)")
    p.add_argument("--stats-interval-seconds", type=_argtype(positive_seconds),
                   default=IDLE_STATS_INTERVAL_SECONDS, metavar="SECONDS",
                   help="outside a canary, write this node's per-revision request statistics "
                        "to etcd at most this often, and only after new requests (the "
                        "operator's fleet request metrics; a canary uses its analysis interval; "
                        "default: %(default)s)")
    p.add_argument("--max-loaded-models", type=_argtype(non_negative_int), default=0,
                   metavar="N",
                   help="most model revisions resident on this Mac at once (seed 004: "
                        "'Per-worker max loaded models: 2'); a load beyond it evicts idle, "
                        "unpinned models least recently used first, else fails ModelLimit and "
                        "is retried; placement assigns no more revisions than this (0 = no limit "
                        "but memory; default: %(default)s, because a canary keeps two revisions "
                        "of one deployment resident, so a default of 2 would block every other "
                        "model on the Mac during a canary: set it per Mac)")
    p.add_argument("--memory-watermark", type=_argtype(memory_watermark), default=WATERMARK,
                   metavar="FRACTION",
                   help="share of this Mac's unified memory resident models may take, in (0, 1]; "
                        "the budget is total memory x FRACTION, capped by the GPU wired-memory "
                        "limit, enforced by the agent and by placement, reported in the node "
                        "record (default: %(default)s, seed 004's 80 %%)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="require 'Authorization: Bearer <key>' on the API with one of the keys "
                        "in this file (one per line, '#' comments, blank lines ignored); the "
                        "file is re-read when it changes, so keys rotate without a restart. "
                        "There is no flag taking a key itself (it would show in ps). Default: "
                        "none, the API is open to anyone who can reach --listen")
    p.add_argument("--forward-key-file", default=None, metavar="PATH",
                   help="fleet-internal key file, the same on every agent: its first key is "
                        "sent with requests this agent forwards to another node (canary "
                        "candidates held elsewhere), and with --api-key-file its keys are "
                        "accepted like client keys; re-read when it changes")
    add_metrics_auth_argument(p)
    add_tls_arguments(p, cert_help="the default advertise URL becomes https://")
    p.add_argument("--forward-ca-file", default=None, metavar="PATH",
                   help="PEM CA bundle that verifies other agents' HTTPS certificates when "
                        "forwarding to them (agents with --tls-cert-file from a private CA); "
                        "default: the system's trusted CAs")
    p.add_argument("--source-policy", default=os.environ.get(ENV_SOURCE_POLICY),
                   metavar="FILE|JSON",
                   help="the fleet's model source policy, the operator's record (a JSON/YAML "
                        "file, or inline JSON starting with '{'): allowed schemes, https hosts, "
                        "file:// roots, hf:// organisations, private networks (docs/security.md, "
                        "'Source policy'). Default: env " + ENV_SOURCE_POLICY + ", else the "
                        "secure policy: https:// to public addresses, hf:// without HF_TOKEN, "
                        "no local directories")
    g = add_insecure_arguments(p, "the agent")
    g.add_argument(INSECURE_FORWARD, action="store_true",
                   help="send the fleet forward key (--forward-key-file) to peers over plain "
                        "http:// on other hosts; without this flag it goes only over https:// "
                        "or to loopback, and a forwarded request to an http:// peer carries no "
                        "key")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log verbosity (default: %(default)s; logs go to stderr)")
    add_etcd_arguments(p)
    return p


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    host, port = args.listen
    credentials = credentials_from_args(args)  # CredentialsError (a ValueError): one line
    metrics = metrics_auth(args.metrics_auth, api_keys=args.api_key_file is not None)
    check_tls_arguments(args)
    check_endpoint(args.etcd_endpoint, credentials)
    policy = load_policy(args.source_policy)  # PolicyError (a ValueError): one line
    return AgentConfig(source_policy=policy, node_name=args.node_name, etcd_endpoint=args.etcd_endpoint,
                       etcd_prefix=args.etcd_prefix, etcd_credentials=credentials,
                       listen_host=host, listen_port=port,
                       advertise_url=args.advertise_url, labels=dict(args.label),
                       lease_ttl=args.lease_ttl, simulated_chip=args.simulated_chip,
                       simulated_memory_bytes=args.simulated_memory,
                       max_queued_requests=args.max_queued_requests,
                       prefetch_window_seconds=args.prefetch_window_seconds,
                       max_prefetches=args.max_prefetches,
                       stats_interval_seconds=args.stats_interval_seconds,
                       max_loaded_models=args.max_loaded_models,
                       memory_watermark=args.memory_watermark,
                       api_key_file=args.api_key_file, forward_key_file=args.forward_key_file,
                       metrics_auth=metrics, tls_cert_file=args.tls_cert_file,
                       tls_key_file=args.tls_key_file, forward_ca_file=args.forward_ca_file,
                       insecure=frozenset(flag for flag in (INSECURE_LISTEN, INSECURE_ETCD,
                                                            INSECURE_FORWARD,
                                                            INSECURE_HTTP_LISTEN)
                                          if getattr(args, flag[2:].replace("-", "_"))),
                       http=http_limits_from_args(args),
                       downloads=download_limits_from_args(args),
                       max_prompt_bytes=args.max_prompt_bytes,
                       max_choices=args.max_choices,
                       serving=serving_options_from_args(args))
