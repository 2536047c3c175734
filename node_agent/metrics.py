"""Prometheus metrics of the node agent's serving core and HTTP API.

All metrics live on a caller-supplied :class:`prometheus_client.CollectorRegistry` (never the
global one), so several agents can share one process (tests, simulations).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.metrics import MetricWrapperBase

__all__ = ["AgentMetrics", "RevisionSeries"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)
_LOAD_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: An unload to standby is one step of the MLX thread plus ``gc`` and ``mx.clear_cache()``
#: (tens of milliseconds); an unassignment's includes its drain, up to the controller's
#: ``DRAIN_SECONDS`` (60 s).
#: Inputs per forward pass of an embedding model (powers of two up to the largest batch, 256).
_EMBED_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_UNLOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RevisionSeries:
    """The series of one revision that the MLX thread updates at every step or token (what
    ``metric.labels(model, revision)`` returns, looked up once instead of per token):
    ``ttft`` / ``inter_token`` histograms, ``generated_tokens`` counter, ``batch_occupancy`` /
    ``queue_depth`` gauges."""

    __slots__ = ("ttft", "inter_token", "generated_tokens", "batch_occupancy", "queue_depth")

    def __init__(self, metrics: "AgentMetrics", model: str, revision: str) -> None:
        self.ttft = metrics.ttft.labels(model, revision)
        self.inter_token = metrics.inter_token.labels(model, revision)
        self.generated_tokens = metrics.generated_tokens.labels(model, revision)
        self.batch_occupancy = metrics.batch_occupancy.labels(model, revision)
        self.queue_depth = metrics.queue_depth.labels(model, revision)


class AgentMetrics:
    """The agent's serving metrics, registered on ``registry``.

    Labels: ``model`` (model id) and ``revision`` everywhere; the request counter also has
    ``endpoint`` (URL path, ``unmatched`` for unknown routes) and ``code`` (HTTP status as a
    string). Label values are bounded: only loaded models' ids and revisions appear; a request
    for a model that is not loaded (or with no parsable model) counts under
    ``model="unknown",revision="unknown"``. Times are seconds.

    * ``mlxfleet_agent_requests_total`` counter, ``{model,revision,endpoint,code}``
    * ``mlxfleet_agent_time_to_first_token_seconds`` histogram: submit → first generated token
    * ``mlxfleet_agent_inter_token_latency_seconds`` histogram: gap between consecutive tokens
    * ``mlxfleet_agent_generated_tokens_total`` / ``mlxfleet_agent_prompt_tokens_total`` counters
    * ``mlxfleet_agent_prompt_cache_hits_total`` counter (requests that reused a cached prefix)
      and ``mlxfleet_agent_prompt_cache_tokens_total`` (prompt tokens served from the cache)
    * ``mlxfleet_agent_coalesced_requests_total`` counter: requests that joined an identical
      request's generation in flight instead of starting one (:mod:`.serving.coalesce`)
    * ``mlxfleet_agent_prompt_cache_hits_total`` / ``mlxfleet_agent_prompt_cache_misses_total``
      counters (requests that did / did not reuse a cached prefix while the prompt cache is on;
      hit ratio = hits ÷ (hits + misses)) and ``mlxfleet_agent_prompt_cache_tokens_total``
      (prompt tokens served from the cache; ÷ ``prompt_tokens_total``: the token hit ratio)
    * ``mlxfleet_agent_stream_buffer_overflows_total`` counter: generations stopped because
      their client read too slowly (``--stream-buffer-chunks``)
    * ``mlxfleet_agent_embedding_batch_inputs`` histogram: inputs per forward pass of an
      embedding model (concurrent requests' inputs share passes: :mod:`.serving.embed_batch`)
    * ``mlxfleet_agent_queue_depth`` gauge: requests waiting for a batch slot
    * ``mlxfleet_agent_batch_occupancy`` gauge: sequences in the running batch
    * ``mlxfleet_agent_model_loaded`` gauge: 1 while loaded, 0 after unload
    * ``mlxfleet_agent_model_load_seconds`` histogram: duration of a load (tokenizer, model
      built lazily, weights read in chunks between decode steps: :mod:`.serving.loading`)
    * ``mlxfleet_agent_model_idle_seconds`` gauge: seconds since the revision's last request
      (resident or standby)
    * ``mlxfleet_agent_download_bytes_total`` counter / ``mlxfleet_agent_download_rate_bytes``
      gauge: a remote source's bytes received and the current rate in bytes/s (0 when not
      downloading)

    Per node (no model labels): ``mlxfleet_agent_serving_option_info{option,value}`` (1 per
    serving option with its value, :meth:`ServingOptions.as_record
    <node_agent.serving.options.ServingOptions.as_record>`),
    ``mlxfleet_agent_model_loads_total{reason}`` (``Assigned``,
    ``ReloadingOnDemand``, ``PredictivePrefetch``), ``mlxfleet_agent_model_unloads_total{reason}``
    (``IdleUnloaded``, ``Evicted``, ``Unassigned``), the histogram
    ``mlxfleet_agent_model_unload_seconds{reason}`` (how long each took: for ``Unassigned``
    including the drain of its running requests) and
    ``mlxfleet_agent_model_unload_freed_bytes_total{reason}`` (MLX memory measured freed by the
    unloads to standby), ``mlxfleet_agent_memory_bytes{kind}`` (``weights``, ``kv_cache``,
    ``mlx_cache``, ``free`` of the node's budget; set by the controller's lifecycle pass),
    ``mlxfleet_agent_model_cache_bytes`` (the downloads in the model cache, after each garbage
    collection) and ``mlxfleet_agent_model_cache_deleted_bytes_total{reason}`` (what the
    collector deleted: ``StalePart``, ``Unassigned``, ``SpaceNeeded``;
    :mod:`node_agent.fetch.gc`).

    A revision's series exist while it is assigned to the node; :meth:`remove_revision` drops
    every one of them when it goes (none is left behind).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        mr = ["model", "revision"]
        self.requests = Counter("mlxfleet_agent_requests_total",
                                "HTTP API requests by model, endpoint and status code",
                                mr + ["endpoint", "code"], registry=registry)
        self.ttft = Histogram("mlxfleet_agent_time_to_first_token_seconds",
                              "Time from request admission to its first generated token", mr,
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.inter_token = Histogram("mlxfleet_agent_inter_token_latency_seconds",
                                     "Time between consecutive generated tokens of a request",
                                     mr, buckets=_LATENCY_BUCKETS, registry=registry)
        self.generated_tokens = Counter("mlxfleet_agent_generated_tokens_total",
                                        "Tokens generated", mr, registry=registry)
        self.prompt_tokens = Counter("mlxfleet_agent_prompt_tokens_total",
                                     "Prompt tokens of admitted requests", mr, registry=registry)
        self.prompt_cache_hits = Counter("mlxfleet_agent_prompt_cache_hits_total",
                                         "Requests whose prompt prefix came from the prompt cache",
                                         mr, registry=registry)
        self.prompt_cache_misses = Counter("mlxfleet_agent_prompt_cache_misses",
                                           "Requests looked up in the prompt cache without "
                                           "reusing a cached prefix", mr, registry=registry)
        self.prompt_cache_tokens = Counter("mlxfleet_agent_prompt_cache_tokens_total",
                                           "Prompt tokens served from the prompt cache", mr,
                                           registry=registry)
        self.coalesced_requests = Counter("mlxfleet_agent_coalesced_requests",
                                          "Requests that joined an identical request's generation "
                                          "in flight instead of starting their own", mr,
                                          registry=registry)
        self.stream_buffer_overflows = Counter(
            "mlxfleet_agent_stream_buffer_overflows",
            "Generations stopped because their client read the stream too slowly "
            "(more chunks waiting than --stream-buffer-chunks)", mr, registry=registry)
        self.embedding_batch_inputs = Histogram(
            "mlxfleet_agent_embedding_batch_inputs",
            "Inputs per forward pass of an embedding model (inputs of concurrent requests "
            "share a pass)", mr, buckets=_EMBED_BATCH_BUCKETS, registry=registry)
        self.serving_option = Info("mlxfleet_agent_serving_option",
                                   "The agent's serving options (prompt cache, its budget, "
                                   "admission policy, stream buffer, request coalescing): one "
                                   "series per option, its value in the label value", ["option"],
                                   registry=registry)
        self.queue_depth = Gauge("mlxfleet_agent_queue_depth",
                                 "Requests waiting for a slot in the running batch", mr,
                                 registry=registry)
        self.batch_occupancy = Gauge("mlxfleet_agent_batch_occupancy",
                                     "Sequences in the running batch (prefill + decode)", mr,
                                     registry=registry)
        self.model_loaded = Gauge("mlxfleet_agent_model_loaded",
                                  "1 while the model is loaded, else 0", mr, registry=registry)
        self.model_load_seconds = Histogram("mlxfleet_agent_model_load_seconds",
                                            "Duration of loading a model", mr,
                                            buckets=_LOAD_BUCKETS, registry=registry)
        self.model_idle_seconds = Gauge("mlxfleet_agent_model_idle_seconds",
                                        "Seconds since the revision's last request", mr,
                                        registry=registry)
        self.download_bytes = Counter("mlxfleet_agent_download_bytes",
                                      "Bytes of a remote model source received", mr,
                                      registry=registry)
        self.download_rate = Gauge("mlxfleet_agent_download_rate_bytes",
                                   "Current download rate of a remote model source in bytes per "
                                   "second, averaged over the last few seconds (0 when not "
                                   "downloading)", mr, registry=registry)
        self.model_loads = Counter("mlxfleet_agent_model_loads",
                                   "Model revision loads by reason (Assigned, ReloadingOnDemand, "
                                   "PredictivePrefetch)", ["reason"], registry=registry)
        self.model_unloads = Counter("mlxfleet_agent_model_unloads",
                                     "Model revision unloads by reason (IdleUnloaded, Evicted, "
                                     "Unassigned)", ["reason"], registry=registry)
        self.model_unload_seconds = Histogram("mlxfleet_agent_model_unload_seconds",
                                              "Duration of unloading a model revision, by "
                                              "reason (IdleUnloaded, Evicted, Unassigned: "
                                              "including the drain of its running requests)",
                                              ["reason"], buckets=_UNLOAD_BUCKETS,
                                              registry=registry)
        self.unload_freed_bytes = Counter("mlxfleet_agent_model_unload_freed_bytes",
                                          "MLX memory measured freed by unloads to standby, by "
                                          "reason", ["reason"], registry=registry)
        self.memory_bytes = Gauge("mlxfleet_agent_memory_bytes",
                                  "Node memory by kind: weights and kv_cache of the resident "
                                  "revisions, mlx_cache (MLX's buffer cache), free (of the "
                                  "node's budget)", ["kind"], registry=registry)
        self.model_cache_bytes = Gauge("mlxfleet_agent_model_cache_bytes",
                                       "Bytes of the downloads in the model cache, measured "
                                       "after each garbage collection", registry=registry)
        self.model_cache_deleted_bytes = Counter("mlxfleet_agent_model_cache_deleted_bytes",
                                                 "Bytes the model cache's garbage collector "
                                                 "deleted, by reason (StalePart, Unassigned, "
                                                 "SpaceNeeded)", ["reason"], registry=registry)
        self._series: dict[tuple[str, str], RevisionSeries] = {}

    def series(self, model: str, revision: str) -> RevisionSeries:
        """The per-step series of ``model``/``revision`` (:class:`RevisionSeries`), made on
        first use and kept until :meth:`remove_revision` drops them. Safe to call from any
        thread (a lookup in a dict)."""
        key = (model, revision)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = RevisionSeries(self, model, revision)
        return found

    def set_serving_options(self, options: dict[str, str]) -> None:
        """Export ``options`` (``{option: value}``) as ``mlxfleet_agent_serving_option_info``."""
        for option, value in options.items():
            self.serving_option.labels(option).info({"value": value})

    def remove_revision(self, model: str, revision: str) -> None:
        """Remove every series labelled ``model``/``revision`` from every family (the revision
        is no longer assigned here)."""
        self._series.pop((model, revision), None)
        for metric in vars(self).values():
            if not isinstance(metric, MetricWrapperBase):
                continue
            names = metric._labelnames  # noqa: SLF001 - the label order of .remove()
            if names[:2] != ("model", "revision"):
                continue
            for values in _label_values(metric):
                if values[:2] == (model, revision):
                    metric.remove(*values)


def _label_values(metric: MetricWrapperBase) -> set[tuple[str, ...]]:
    """The label-value tuples of ``metric``'s series, from its collected samples."""
    names = metric._labelnames  # noqa: SLF001
    out: set[tuple[str, ...]] = set()
    for family in metric.collect():
        for sample in family.samples:
            if all(n in sample.labels for n in names):
                out.add(tuple(sample.labels[n] for n in names))
    return out
