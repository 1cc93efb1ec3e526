"""A client node's counters: Prometheus metrics in a registry of their own (`jetctl_client_*`,
base units, counters end in `_total`, no per-id labels), and the figures of its status
(`NodeStats`).

    metrics = ClientMetrics()
    port = metrics.serve("127.0.0.1", 0)   # http://127.0.0.1:port/metrics

Left out: per-trajectory labels (unbounded cardinality), push gateways.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

ROLLOUT_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)


@dataclass
class NodeStats:
    """What a node counted since it started (its status figures); production counts the
    rollouts and groups, delivery the acks, both the dropped trajectories by reason."""

    rollouts_done: int = 0
    rollouts_failed: int = 0
    rollouts_timeout: int = 0
    groups_spooled: int = 0
    groups_dropped: int = 0
    groups_finished: int = 0
    acks: dict[str, int] = field(default_factory=dict)
    busy_refusals: int = 0  # Submits refused RESOURCE_EXHAUSTED with a retry-after
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n


class ClientMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.rollouts = Counter(
            "jetctl_client_rollouts_total",
            "Rollouts finished, by task and outcome (ok | failed | timeout).",
            ["task", "outcome"],
            registry=self.registry,
        )
        self.rollout_duration = Histogram(
            "jetctl_client_rollout_duration_seconds",
            "Wall time of one rollout, process start to result.",
            buckets=ROLLOUT_BUCKETS_S,
            registry=self.registry,
        )
        self.spool_groups = Gauge(
            "jetctl_client_spool_groups",
            "Groups in the spool waiting for an ack.",
            registry=self.registry,
        )
        self.spool_oldest_age = Gauge(
            "jetctl_client_spool_oldest_age_seconds",
            "Age of the oldest un-acked group in the spool.",
            registry=self.registry,
        )
        self.server_reachable = Gauge(
            "jetctl_client_server_reachable",
            "1 when the last call to the model's server got an answer, else 0.",
            registry=self.registry,
        )
        self.concurrency = Gauge(
            "jetctl_client_concurrency",
            "Rollouts the node may run at once (concurrency: auto moves it; else the recipe's).",
            registry=self.registry,
        )
        self.delivery_errors = Counter(
            "jetctl_client_delivery_errors_total",
            "Unexpected errors of the spool's sender (logged with a traceback; it goes on).",
            registry=self.registry,
        )
        self.group_errors = Counter(
            "jetctl_client_group_errors_total",
            "Groups whose task raised before they were spooled (logged with a traceback; "
            "their trajectories in progress are recorded as dropped(failed)).",
            registry=self.registry,
        )
        self.dropped = Counter(
            "jetctl_client_trajectories_dropped_total",
            "Trajectories the node gave up on, by reason (timeout | failed | dead-letter).",
            ["reason"],
            registry=self.registry,
        )
        self._httpd: WSGIServer | None = None

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve /metrics on a background thread; returns the bound port."""
        httpd, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._httpd = httpd
        return int(httpd.server_address[1])

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
