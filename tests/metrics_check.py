"""Reading a /metrics answer in tests: the official parser, and promtool's lint.

promtool (Debian's ``prometheus`` package; scripts/setup.sh installs it) is
required, not optional: a test that skipped itself where promtool is missing
would pass in exactly the CI image that lost it, and nobody would notice the
lint had stopped running.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Scrape:
    text: str
    families: dict[str, Metric] = field(default_factory=dict)

    def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        """Every sample named ``name`` (a counter's ``_total``, a histogram's ``_count`` ...)."""
        return [(s.labels, s.value) for f in self.families.values() for s in f.samples
                if s.name == name]

    def value(self, name: str) -> float:
        found = self.samples(name)
        assert len(found) == 1, f"{name}: {len(found)} samples"
        return found[0][1]

    def by(self, name: str, *labels: str) -> dict:  # type: ignore[type-arg]
        """``name``'s samples keyed by one label's value, or by a tuple of several."""
        out = {}
        for sample_labels, value in self.samples(name):
            key = tuple(sample_labels[label] for label in labels)
            out[key[0] if len(key) == 1 else key] = value
        return out


def parse_scrape(text: str) -> Scrape:
    scrape = Scrape(text)
    for family in text_string_to_metric_families(text):
        assert family.name not in scrape.families, f"{family.name} appears twice"
        scrape.families[family.name] = family
    return scrape


def promtool_check(text: str) -> None:
    """``promtool check metrics``: Prometheus's own lint of names, units and types."""
    promtool = shutil.which("promtool")
    assert promtool, ("promtool is missing: apt-get install prometheus "
                      "(scripts/setup.sh does it where it can)")
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
