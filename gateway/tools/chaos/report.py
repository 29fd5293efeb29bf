"""The report of a chaos run: the counts of what was done and faulted, the
judge's verdict (`chaos_judge`), and its rendering for people."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gateway.tools.chaos import late as late_mode
from gateway.tools.chaos.context import RunContext, Tally, job_keys
from gateway.tools.chaos.judge import INVARIANTS, FinalLease, Findings, judge
from leases.urls import redact_url

Leases = dict[str, FinalLease | None]  # each job's lease in the store at the end


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's options as given, with any password in the store URL hidden (the
    report is meant to be kept and shared)."""
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "keep")}
    if isinstance(settings.get("store"), str):
        settings["store"] = redact_url(settings["store"])
    if isinstance(settings.get("ports"), range):
        settings["ports"] = f"{settings['ports'].start}-{settings['ports'].stop - 1}"
    return settings


def build_report(
    args: argparse.Namespace,
    ctx: RunContext,
    record: dict[str, Any],
    final: Leases,
    kills: int,
    elapsed: float,
    workdir: Path,
    strands: bool = False,
) -> dict[str, Any]:
    tally: Tally = ctx.tally
    findings = _findings(args, ctx, record, final, killed=kills > 0 or strands)
    done = sum(1 for lease in final.values() if lease is not None and lease.state == "done")
    return {
        "settings": _settings(args),
        "mode": "bypass-gateway" if args.bypass_gateway else "gateway",
        "destination_fence": args.fenced_destination,
        "elapsed_s": round(elapsed, 2),
        "jobs": {"total": len(ctx.jobs), "completed": done, "steps_per_job": ctx.steps},
        "claims": {
            "granted": tally.claims,
            "conflicts": tally.claim_conflicts,
            "refused_job_completed": tally.claims_of_completed,
        },
        "pauses_past_lease": tally.pauses_past_lease,
        **_stale(tally),
        "writes": _writes(tally, findings),
        "leases_lost": dict(tally.leases_lost),
        "rejections": dict(tally.rejections),
        "lease_calls_failed": tally.lease_calls_failed,
        "completions_confirmed_after_lost_answer": len(tally.completions_confirmed),
        "faults": _faults(args, record, tally, kills),
        "clock_rates": [
            round(min(tally.clock_rates, default=1), 3),
            round(max(tally.clock_rates, default=1), 3),
        ],
        "destination": {
            "requests": record["requests"],
            "effects": len(record["effects"]),
            "deduplicated": record["deduplicated"],
            **late_mode.destination_counts(args, record, tally),
        },
        "unexpected": tally.unexpected[:20],
        "violations": {name: len(findings.violations[name]) for name in INVARIANTS},
        "violation_examples": {
            name: items[:5] for name, items in findings.violations.items() if items
        },
        "violation_count": findings.count,
    }


def _findings(
    args: argparse.Namespace, ctx: RunContext, record: dict[str, Any], final: Leases, killed: bool
) -> Findings:
    tally = ctx.tally
    return judge(
        effects=record["effects"],
        dropped_before=record["dropped_before"],
        jobs={job: job_keys(job, ctx.steps) for job in ctx.jobs},
        final=final,
        completions=tally.completions,
        confirmed=tally.completions_confirmed,
        unknown_keys=tally.unknown_keys,
        upstream_idempotent=args.upstream_idempotent,
        gateways_killed=killed,
        fenced=late_mode.fenced_keys(record),
        stale_accepted=tally.stale_accepted,
    )


def _stale(tally: Tally) -> dict[str, Any]:
    """What the workers that woke past their lease tried, and what came of it."""
    return {
        "stale_writes": {
            "attempted": tally.stale_writes_attempted,
            "rejected": dict(tally.stale_writes_rejected),
            "accepted": tally.stale_writes_accepted,
        },
        "stale_completions": {
            "attempted": tally.stale_completions_attempted,
            "rejected": dict(tally.stale_completions_rejected),
            "accepted": tally.stale_completions_accepted,
        },
    }


def _writes(tally: Tally, findings: Findings) -> dict[str, Any]:
    return {
        "sent": tally.writes_sent,
        "applied": tally.writes_applied,
        "duplicates_replayed": tally.duplicates_replayed,
        "outcome_unknown_keys": len(tally.unknown_keys),
        "unknown_and_applied": findings.unknown_applied,
        "unknown_and_not_applied": findings.unknown_unapplied,
        "rejected_in_hold": dict(tally.writes_rejected_in_hold),
        "retried": dict(tally.retries),
    }


def _faults(
    args: argparse.Namespace, record: dict[str, Any], tally: Tally, kills: int
) -> dict[str, Any]:
    skewed = [r for r in tally.clock_rates if abs(r - 1.0) >= 0.01]
    return {
        **{f"upstream_{k}": v for k, v in record["faults"].items()},
        "pauses_past_lease": tally.pauses_past_lease,
        "competing_claims": tally.claim_conflicts,
        "skewed_clocks": len(skewed),
        "gateway_kills": kills,
        **late_mode.fault_counts(args, tally),
    }


def render(report: dict[str, Any]) -> str:
    """The report for people: one line per count."""
    lines = [f"sinkgate chaos ({report['mode']}, seed {report['settings']['seed']}, "
             f"{report['elapsed_s']}s)"]  # fmt: skip

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key in sorted(value):
                walk(f"{prefix}.{key}" if prefix else key, value[key])
        elif prefix not in ("settings", "mode", "elapsed_s"):
            lines.append(f"  {prefix:<44} {'none' if value == {} else value}")

    for key in ("jobs", "claims", "pauses_past_lease", "stale_writes", "stale_completions",
                "writes", "leases_lost", "rejections", "faults", "store_unavailable", "destination",
                "violations"):  # fmt: skip
        walk(key, report.get(key))
    for name, items in report["violation_examples"].items():
        lines.append(f"  {name}:")
        lines.extend(f"    - {item}" for item in items)
    for item in report["unexpected"]:
        lines.append(f"  unexpected: {item}")
    lines.extend(late_mode.report_lines(report))
    verdict = "FAILED" if report["violation_count"] else "OK"
    lines.append(f"{verdict}: {report['violation_count']} violation(s)")
    return "\n".join(lines)
