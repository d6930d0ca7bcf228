"""One Prometheus exposition for the fleet: every replica's series, each with a `replica` label.

Replicas publish their own `/metrics` text (the single-process server's, unchanged); the ingress merges them
here so that a Prometheus scraping the app's port sees one target with every replica's series, and the
dashboards select or sum by `replica`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

REPLICA_LABEL = "replica"


class _Merged:
    """A collector that yields the parsed families it was given."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def merge_expositions(texts: Mapping[str, str]) -> bytes:
    """The families of every replica's exposition, each sample labelled with its replica, in one text."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            into.samples.extend(
                Sample(s.name, {**s.labels, REPLICA_LABEL: replica}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))
    return generate_latest(registry)
