"""Prometheus metrics of a swarm server (`jetctl_server_*`, base units: seconds and bytes,
counters end in `_total`, no per-id labels)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.received = Counter(
            "jetctl_server_trajectories_received", "Trajectories received by Submit",
            ["task"], registry=r,
        )
        self.rejected = Counter(
            "jetctl_server_trajectories_rejected", "Trajectories refused, by reason",
            ["reason"], registry=r,
        )
        self.deferred = Counter(
            "jetctl_server_trajectories_deferred",
            "Trajectories not stored because the buffer was full (ack BUSY: the client resends)",
            registry=r,
        )
        self.refused_calls = Counter(
            "jetctl_server_calls_refused", "RPCs refused before any work, by reason",
            ["reason"], registry=r,
        )
        # a Generate refused past limits.max_queued_generates counts in refused_calls as
        # reason="engine_busy"; this is the queue it was measured against
        self.generates_waiting = Gauge(
            "jetctl_server_generate_waiting",
            "Generate calls waiting for a row of the engine, as the last Generate found them",
            registry=r,
        )
        self.model_version = Gauge(
            "jetctl_server_model_version", "Optimizer steps completed", registry=r
        )
        self.version_lag = Histogram(
            "jetctl_server_trajectory_version_lag", "Server version minus a group's oldest call",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r,
        )
        self.buffer_groups = Gauge(
            "jetctl_server_buffer_groups", "Accepted groups waiting to be trained", registry=r
        )
        self.train_step_seconds = Histogram(
            "jetctl_server_train_step_duration_seconds", "Wall time of one optimizer step",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128), registry=r,
        )
        self.publish_seconds = Histogram(
            "jetctl_server_weight_publish_duration_seconds", "Serializing and streaming weights",
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30), registry=r,
        )
        self.tokens_generated = Counter(
            "jetctl_server_tokens_generated", "Completion tokens generated", registry=r
        )
        self.tokens_trained = Counter(
            "jetctl_server_tokens_trained", "Tokens fed to the trainer", registry=r
        )
        self.last_checkpoint = Gauge(
            "jetctl_server_last_checkpoint_timestamp_seconds", "Time of the last checkpoint",
            registry=r,
        )
        self.generate_batch_size = Histogram(
            "jetctl_server_generate_batch_size", "Requests per generation batch",
            buckets=(1, 2, 4, 8, 16, 32, 64), registry=r,
        )
        self.reward = Gauge(
            "jetctl_server_reward_mean", "Mean reward of the last trained batch", registry=r
        )

    def on_step(self, scalars: dict[str, float]) -> None:
        self.model_version.set(scalars["step"])
        self.train_step_seconds.observe(scalars["timing/train_s"])
        self.tokens_trained.inc(scalars.get("num_tokens", 0.0))
        self.reward.set(scalars["reward/mean"])
        self.buffer_groups.set(scalars["buffer/depth"])
