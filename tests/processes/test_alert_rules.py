"""The sample Prometheus alert rules of docs/operating.md: `promtool` accepts them, and the
unknown-outcome alert fires on a queue that stays non-empty (and not before).

Needs `promtool` (Debian's `prometheus` package); skipped with the reason when it
is missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "operating.md"

UNIT_TEST = """
rule_files: [rules.yml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # two replicas report the same store-wide count: max, not sum
      - series: 'sinkgate_unknown_keys{destination="payments", instance="a"}'
        values: '0 3x40'
      - series: 'sinkgate_unknown_keys{destination="payments", instance="b"}'
        values: '0 3x40'
      - series: 'sinkgate_unknown_keys{destination="emails", instance="a"}'
        values: '0x40'
    alert_rule_test:
      - eval_time: 10m
        alertname: SinkgateUnknownOutcomes
        exp_alerts: []
      - eval_time: 20m
        alertname: SinkgateUnknownOutcomes
        exp_alerts:
          - exp_labels: {severity: ticket, destination: payments}
            exp_annotations:
              summary: "payments: 3 write(s) with an unknown outcome"
              description: "Retries of these keys get 409 outcome_unknown until an operator checks the destination and resolves them (sinkgate keys --state unknown)."
      - eval_time: 20m
        alertname: SinkgateUnknownOutcomesPiling
        exp_alerts: []
"""  # noqa: E501 - promtool compares the annotation verbatim


def readme_rules() -> str:
    """The YAML block of the page's "What to alert on"."""
    text = PAGE.read_text()
    section = text[text.index("## What to alert on") :]
    match = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert match is not None, "no yaml block under 'What to alert on'"
    return match.group(1)


@pytest.fixture
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not found (Debian: apt-get install prometheus)")
    return found


def test_promtool_accepts_the_readme_rules(promtool, tmp_path):
    (tmp_path / "rules.yml").write_text(readme_rules())
    result = subprocess.run(
        [promtool, "check", "rules", str(tmp_path / "rules.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 3 rules found" in result.stdout + result.stderr


def test_the_unknown_outcome_alert_fires_after_15_minutes(promtool, tmp_path):
    (tmp_path / "rules.yml").write_text(readme_rules())
    (tmp_path / "test.yml").write_text(UNIT_TEST)
    result = subprocess.run(
        [promtool, "test", "rules", "test.yml"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
