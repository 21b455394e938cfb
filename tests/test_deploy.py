"""deploy/: systemd units, Prometheus config and alert rules, Grafana dashboard, example configs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml  # promtool-independent parse; PyYAML ships with the dev environment's dependencies
from prometheus_client.parser import text_string_to_metric_families

from pfec.common.node.config import load_config
from pfec.node.config import load_node_config
from pfec.receiver.metrics import ReceiverMetrics
from pfec.sender.metrics import SenderMetrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
PROMTOOL = shutil.which("promtool")
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
UNITS = {kind: DEPLOY / f"pfec-{kind}.service" for kind in ("sender", "receiver", "node")}
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian package 'prometheus')"
)


def _sample_names() -> set[str]:
    names: set[str] = set()
    for m in (SenderMetrics(process_metrics=False), ReceiverMetrics(process_metrics=False)):
        for fam in text_string_to_metric_families(m.exposition().decode()):
            names.update(s.name for s in fam.samples)
    return names


def _metric_refs(expr: str) -> set[str]:
    return set(re.findall(r"\bpfec_[a-z0-9_]+", expr))


# --------------------------------------------------------------------------- systemd units


def _directives(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


@pytest.mark.parametrize("kind", ["sender", "receiver", "node"])
def test_unit_hardening(kind: str) -> None:
    d = _directives(UNITS[kind])
    one = {k: v[-1] for k, v in d.items()}
    assert one["ExecStart"] == f"/opt/pfec/.venv/bin/pfec {kind} serve --config /etc/pfec/{kind}.toml"
    assert one["DynamicUser"] == "yes" and one["User"] == "pfec"
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "RuntimeDirectory": "pfec",
        "StateDirectory": "pfec",
        "CacheDirectory": "pfec",
        "LoadCredential": "psk:/etc/pfec/psk",
        "Restart": "on-failure",
        "AmbientCapabilities": "",
        "CapabilityBoundingSet": "",
    }.items():
        assert one.get(key) == value, (kind, key, one.get(key))
    assert "MemoryDenyWriteExecute" not in d  # numba JIT needs W+X pages
    assert "LimitNOFILE" in d and "TasksMax" in d and "MemoryMax" in d


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed")
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """`systemd-analyze verify` on copies whose ExecStart binary is rewritten to an existing one.

    verify insists that the ExecStart binary exists; /opt/pfec/.venv/bin/pfec does not on a build machine,
    so the copies run /bin/true (the command line is checked by test_unit_hardening). Unknown keys or bad
    values are only warnings (exit status 0), so any diagnostic naming a unit fails the test.
    """
    true = shutil.which("true") or "/bin/true"
    copies = []
    for path in UNITS.values():
        text = path.read_text()
        assert "ExecStart=/opt/pfec/.venv/bin/pfec " in text
        copy = tmp_path / path.name
        copy.write_text(text.replace("ExecStart=/opt/pfec/.venv/bin/pfec ", f"ExecStart={true} "))
        copies.append(str(copy))
    assert SYSTEMD_ANALYZE is not None
    proc = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", *copies], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    diag = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "pfec-" in ln or str(tmp_path) in ln]
    assert proc.returncode == 0 and not diag, proc.stdout + proc.stderr
    # The checker does catch mistakes: a misspelt key is reported.
    bad = tmp_path / "pfec-bad.service"
    bad.write_text(Path(copies[0]).read_text().replace("ProtectHome=yes", "ProtectHom=yes"))
    proc = subprocess.run([SYSTEMD_ANALYZE, "verify", str(bad)], capture_output=True, text=True, timeout=120)
    assert "ProtectHom" in proc.stdout + proc.stderr


# --------------------------------------------------------------------------- Prometheus


@needs_promtool
def test_promtool_check_rules_and_config() -> None:
    assert PROMTOOL is not None
    for args in (["check", "rules", "pfec-alerts.yml"], ["check", "config", "prometheus.yml"]):
        proc = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=DEPLOY)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "SUCCESS" in proc.stdout + proc.stderr


def _alert_exprs() -> dict[str, str]:
    doc = yaml.safe_load((DEPLOY / "pfec-alerts.yml").read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def test_alerts_reference_defined_metrics() -> None:
    pytest.importorskip("yaml", reason="PyYAML not installed")
    exprs = _alert_exprs()
    known = _sample_names()
    for name in (
        "PfecDecoderStalling",
        "PfecDeadlineOverruns",
        "PfecDeadlineLatenessP99High",
        "PfecHandoffFailures",
        "PfecReceiverAuthDrops",
        "PfecSenderAuthDrops",
    ):
        assert name in exprs
    for name, expr in exprs.items():
        missing = _metric_refs(expr) - known
        assert not missing, f"alert {name} uses undefined metrics {sorted(missing)}"


_RULE_TESTS = """
rule_files:
  - {rules}
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'pfec_receiver_deadline_overruns_total{{instance="r:9400", job="pfec-receiver"}}'
        values: '0+1x30'
      - series: 'pfec_receiver_deadline_overruns_total{{instance="q:9400", job="pfec-receiver"}}'
        values: '0x30'
      - series: 'pfec_receiver_datagrams_dropped_total{{instance="r:9400", reason="auth"}}'
        values: '0+120x30'
      - series: 'pfec_sender_handoffs_total{{instance="s:9401", job="pfec-sender", outcome="failed"}}'
        values: '0+1x40'
      - series: 'pfec_sender_handoffs_total{{instance="s:9401", job="pfec-sender", outcome="done"}}'
        values: '0+1x40'
      - series: 'up{{instance="s:9401", job="pfec-sender"}}'
        values: '1 1 0 0 0 0 0 0 0 0'
    alert_rule_test:
      - eval_time: 15m
        alertname: PfecDeadlineOverruns
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "r:9400", job: "pfec-receiver"}}
            exp_annotations:
              summary: "10 deadline overruns in 10 min on r:9400"
              description: >-
                Generation started late: the receiver's event loop is overloaded (CPU, GC, model rebuild)
                or the node is swapping. See pfec_receiver_deadline_lateness_seconds.
      - eval_time: 15m
        alertname: PfecReceiverAuthDrops
        exp_alerts:
          - exp_labels: {{severity: critical, instance: "r:9400"}}
            exp_annotations:
              summary: "2/s datagrams fail auth/replay checks on r:9400"
              description: >-
                Compare the PSK fingerprints of both nodes (pfec keygen prints one) and look for foreign
                traffic on the UDP port.
      - eval_time: 35m
        alertname: PfecHandoffFailures
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "s:9401"}}
            exp_annotations:
              summary: "50% of handoffs fail or are refused on s:9401"
              description: >-
                Refusals name their reason in the control API's answer (fingerprint mismatch: both nodes must
                run the same model and wire version; overloaded: receiver limits.max_sessions).
      - eval_time: 8m
        alertname: PfecDaemonDown
        exp_alerts:
          - exp_labels: {{severity: critical, instance: "s:9401", job: "pfec-sender"}}
            exp_annotations:
              summary: "pfec-sender on s:9401 is not scraped"
              description: "systemctl status pfec-sender / pfec-receiver; journalctl -u pfec-receiver"
      - eval_time: 3m
        alertname: PfecDaemonDown
        exp_alerts: []
"""


@needs_promtool
def test_promtool_rule_unit_tests(tmp_path: Path) -> None:
    """Synthetic series make the alerts fire (and not fire) with the labels and texts we expect."""
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(_RULE_TESTS.format(rules=DEPLOY / "pfec-alerts.yml"))
    assert PROMTOOL is not None
    proc = subprocess.run([PROMTOOL, "test", "rules", str(spec)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- Grafana


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    out = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            out.append((panel["title"], t["expr"]))
    return out


def test_dashboard_is_valid_and_complete() -> None:
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["title"]
    for panel in dash["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert all(t["refId"] for t in panel["targets"])
    exprs = _dashboard_exprs()
    known = _sample_names()
    for title, expr in exprs:
        missing = _metric_refs(expr) - known
        assert not missing, f"panel {title!r} uses undefined metrics {sorted(missing)}"
        assert expr.count("(") == expr.count(")"), (title, expr)
    used = set().union(*(_metric_refs(e) for _, e in exprs))
    for required in (
        "pfec_receiver_decoder_stalls_total",
        "pfec_receiver_deadline_overruns_total",
        "pfec_receiver_deadline_lateness_seconds_bucket",
        "pfec_receiver_recovered_utility_bucket",
        "pfec_receiver_ttft_seconds_bucket",
        "pfec_sender_datagrams_sent_total",
        "pfec_receiver_datagrams_received_total",
        "pfec_receiver_datagrams_dropped_total",
        "pfec_sender_datagrams_dropped_total",
        "pfec_receiver_sessions_active",
        "pfec_receiver_sessions_pending",
        # issue 13: precision, planner and this node's prefill speed
        "pfec_sender_precision_bytes_sent_total",
        "pfec_sender_planner_choices_total",
        "pfec_sender_handoff_modes_total",
        "pfec_prefill_tokens_per_second",
        "pfec_torch_threads",
    ):
        assert required in used, f"dashboard has no panel for {required}"


# --------------------------------------------------------------------------- example configs


def test_the_node_unit_replaces_the_two_daemons() -> None:
    """A node with both roles loads the model once: its unit stops the sender's and the receiver's."""
    d = _directives(UNITS["node"])
    assert d["Conflicts"] == ["pfec-sender.service pfec-receiver.service"]


@pytest.mark.parametrize("kind", ["sender", "receiver", "node"])
def test_example_configs_load_and_show_the_defaults(kind: str) -> None:
    path = DEPLOY / f"{kind}.example.toml"
    if kind == "node":
        cfg, default = load_node_config(path, {}), load_node_config(None, {})
    else:
        cfg = load_config(kind, path, {})  # type: ignore[call-overload]
        default = load_config(kind, None, {})  # type: ignore[call-overload]
    # The examples document the defaults (keep them in step with common/node/config.py), except the
    # profile directory, which the units' layout fixes (the repository at /opt/pfec): the default is the
    # repository's profiles/ folder wherever it is.
    assert cfg.profiles.directory == Path("/opt/pfec/profiles")
    assert default.profiles.directory == Path(__file__).resolve().parents[1] / "profiles"
    assert cfg.model_copy(update={"profiles": default.profiles}) == default


def test_netem_recipe_maps_main_ge() -> None:
    text = (DEPLOY / "netem.md").read_text()
    # MAIN_GE = ge:0.001,0.5,0.02,0.1 -> p = PGB, r = PBG, 1-h = EB, 1-k = EG, in percent.
    assert "loss gemodel 2% 10% 50% 0.1%" in text
    assert "rate 100mbit delay 10ms" in text
