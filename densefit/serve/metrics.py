"""Prometheus text exposition for ``densefit serve`` (``GET /metrics``), with no dependency.

Counters of requests by route, method and status, a latency histogram per route, errors by
kind (``store_unavailable``: answers of 503 because the store's engine could not be
reached), whether the store answers and its number of documents, and the micro-batcher's
forward passes and batch sizes.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

from densefit.retrieval.index.types import StoreUnavailableError

__all__ = ["LATENCY_BUCKETS", "Metrics"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def _labels(**labels: str) -> str:
    """``{a="x",b="y"}`` with values escaped as the text format requires."""
    parts = []
    for key, value in labels.items():
        escaped = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        parts.append(f'{key}="{escaped}"')
    return "{" + ",".join(parts) + "}"


class _Histogram:
    def __init__(self, buckets: tuple):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += 1
        self.sum += value

    def lines(self, name: str, **labels: str) -> list[str]:
        out = [
            f"{name}_bucket{_labels(**labels, le=repr(float(b)))} {c}"
            for b, c in zip(self.buckets, self.counts, strict=True)
        ]
        out.append(f"{name}_bucket{_labels(**labels, le='+Inf')} {self.total}")
        out.append(f"{name}_sum{_labels(**labels) if labels else ''} {self.sum}")
        out.append(f"{name}_count{_labels(**labels) if labels else ''} {self.total}")
        return out


class Metrics:
    """Thread-safe counters and histograms, rendered by :meth:`render` in Prometheus text.

    >>> m = Metrics()
    >>> m.observe_request("/search", "POST", 200, 0.004)
    >>> 'densefit_requests_total{route="/search",method="POST",status="200"} 1' in m.render()
    True
    """

    def __init__(self, documents: Callable[[], int] | None = None):
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self._latency: dict[str, _Histogram] = {}
        self._errors: dict[str, int] = defaultdict(int)
        self._batches = _Histogram(BATCH_BUCKETS)
        self._writes = 0
        self._documents = documents

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count one finished request and its latency."""
        with self._lock:
            self._requests[(route, method, int(status))] += 1
            hist = self._latency.get(route)
            if hist is None:
                hist = self._latency[route] = _Histogram(LATENCY_BUCKETS)
            hist.observe(seconds)
            if status >= 400:
                self._errors["client" if status < 500 else "server"] += 1

    def observe_error(self, kind: str) -> None:
        """Count an error that is not a response status (e.g. a failed write)."""
        with self._lock:
            self._errors[kind] += 1

    def observe_batch(self, size: int) -> None:
        """Count one batched forward pass of ``size`` queries."""
        with self._lock:
            self._batches.observe(size)

    def observe_write(self) -> None:
        """Count one committed write."""
        with self._lock:
            self._writes += 1

    @property
    def encode_batches(self) -> int:
        """Forward passes the micro-batcher made so far."""
        return self._batches.total

    def render(self) -> str:
        """Everything, in the Prometheus text exposition format (version 0.0.4)."""
        with self._lock:
            lines = [
                "# HELP densefit_requests_total HTTP requests by route, method and status.",
                "# TYPE densefit_requests_total counter",
            ]
            for (route, method, status), n in sorted(self._requests.items()):
                lines.append(
                    f"densefit_requests_total{_labels(route=route, method=method, status=str(status))} {n}"
                )
            lines += [
                "# HELP densefit_request_seconds Request latency by route.",
                "# TYPE densefit_request_seconds histogram",
            ]
            for route, hist in sorted(self._latency.items()):
                lines += hist.lines("densefit_request_seconds", route=route)
            lines += [
                "# HELP densefit_errors_total Errors: client (4xx), server (5xx), write, "
                "store_unavailable (503: the store's engine could not be reached).",
                "# TYPE densefit_errors_total counter",
            ]
            for kind in sorted(set(self._errors) | {"client", "server", "store_unavailable"}):
                lines.append(f"densefit_errors_total{_labels(kind=kind)} {self._errors[kind]}")
            lines += [
                "# HELP densefit_query_batch_size Queries per batched forward pass.",
                "# TYPE densefit_query_batch_size histogram",
                *self._batches.lines("densefit_query_batch_size"),
                "# HELP densefit_writes_total Committed writes (upserts and deletes).",
                "# TYPE densefit_writes_total counter",
                f"densefit_writes_total {self._writes}",
            ]
        if self._documents is not None:
            try:
                documents = self._documents()
            except StoreUnavailableError:  # the engine is unreachable: say so, no count
                documents = None
            lines += [
                "# HELP densefit_store_up Whether the store answered (1) or not (0).",
                "# TYPE densefit_store_up gauge",
                f"densefit_store_up {int(documents is not None)}",
            ]
            if documents is not None:
                lines += [
                    "# HELP densefit_documents Documents in the store.",
                    "# TYPE densefit_documents gauge",
                    f"densefit_documents {documents}",
                ]
        return "\n".join(lines) + "\n"
