"""deploy/: the alert rules pass promtool's checks and unit tests, and everything the
rules, the example Prometheus config and the Grafana dashboard name exists.

promtool is required, not optional (tests/metrics_check.py says why).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "llmgw-alerts.yml"
RULE_TESTS = PROMETHEUS_DIR / "llmgw-alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "llmgw-fleet.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"
JOBS = {"llmgw-control", "llmgw-gateway", "llmgw-agent"}


def promtool(*args: str, cwd: Path = PROMETHEUS_DIR) -> str:
    tool = shutil.which("promtool")
    assert tool, "promtool is missing: apt-get install prometheus (scripts/setup.sh does it)"
    done = subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def alert_rules() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"]}


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def test_promtool_checks_the_rules() -> None:
    out = promtool("check", "rules", RULES.name)
    assert f"SUCCESS: {len(alert_rules())} rules found" in out


def test_promtool_unit_tests_pass() -> None:
    assert "SUCCESS" in promtool("test", "rules", RULE_TESTS.name)


def test_every_alert_is_tested_firing_and_quiet() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert tests["rule_files"] == [RULES.name]
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fires == set(alert_rules())
    # Target-down and store-unreadable are plain comparisons of one gauge.
    assert set(alert_rules()) - quiet == {"LlmgwTargetDown", "LlmgwStoreUnreadable",
                                          "LlmgwDeviceUnhealthy"}


def test_every_alert_says_what_to_do() -> None:
    for name, rule in alert_rules().items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def documented_families() -> set[str]:
    return set(re.findall(r"^\| `(llmgw_[a-z_]+)` \|", METRICS_DOC.read_text(), re.MULTILINE))


def named_metrics(exprs: list[str]) -> set[str]:
    found = set()
    for expr in exprs:
        for name in re.findall(r"\bllmgw_[a-z_]+", expr):
            found.add(re.sub(r"_(bucket|count|sum)$", "", name))
    return found


@pytest.mark.parametrize("where", ["rules", "dashboard"])
def test_every_metric_named_is_documented(where: str) -> None:
    exprs = ([r["expr"] for r in alert_rules().values()] if where == "rules"
             else dashboard_exprs())
    names = named_metrics(exprs)
    assert names, where
    assert names - documented_families() == set()


def test_the_rules_and_dashboard_cover_the_families() -> None:
    """A family neither alerted on nor drawn is one nobody will look at."""
    used = named_metrics([r["expr"] for r in alert_rules().values()] + dashboard_exprs())
    # For joins and debugging, not for a panel.
    unused = {"llmgw_agent_info", "llmgw_agent_reports_sent_total",
              "llmgw_agent_node_memory_total_bytes", "llmgw_agent_device_placeable",
              "llmgw_gateway_config_version"}
    assert documented_families() - used == unused


def test_the_dashboard_is_well_formed() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "model"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    taken: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        cells = {(g["y"] + dy, g["x"] + dx) for dy in range(g["h"]) for dx in range(g["w"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), panel["title"]


def test_the_example_scrape_config_is_valid(tmp_path: Path) -> None:
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert {job["job_name"] for job in config["scrape_configs"]} == JOBS
    # Its paths are the operator's (/etc/prometheus); check it with real files.
    config["rule_files"] = [str(RULES)]
    token = tmp_path / "token"
    token.write_text("secret\n")
    (tmp_path / "agents.json").write_text("[]")
    for job in config["scrape_configs"]:
        job["authorization"]["credentials_file"] = str(token)
        for sd in job.get("file_sd_configs", []):
            sd["files"] = [str(tmp_path / "agents.json")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    # The rules select jobs by these names.
    assert 'job=~"llmgw-.*"' in RULES.read_text()
