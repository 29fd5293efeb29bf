"""The chaos run's checks: PURE functions of the destination's record, the lease
store's final state and what the workers were told.

Invariants (names as reported):

1. `no_stale_effect` - per job, in the destination's arrival order, no effect
   carries a generation older than one already applied for that job.
2. `no_duplicate_effect` - no idempotency key applied twice. A destination that
   deduplicates by key itself (`--upstream-idempotent`) applies a repeated key
   once and counts the repeat as `deduplicated`; its record is checked the same.
3. `completed_exactly_once` - every job is `done` in the lease store; the store
   acknowledged at most one completion for it (a zombie's completion never), and
   the `done` generation is the one whose completion it acknowledged.
4. `effects_of_completed_jobs` - each of the `steps` keys of a done job was
   applied, except a key whose outcome the gateway declared unknown to a worker
   (`outcome_unknown`, `upstream_timeout`, `upstream_disconnected`): the contract
   (SPEC 2 step 8) lets such a key go unapplied, because the gateway cannot know
   whether the request reached the destination and will never send it twice.
   Even then the absence must be explained by the destination's own record - it
   dropped a request with that key before applying it - or, in a run that kills
   gateways, by no request with that key ever arriving (killed between reserving
   the key and forwarding it), or by the destination's own fence refusing it
   (`--fenced-destination`: a late write of an older generation). With
   `--upstream-idempotent` the gateway forwards an unknown key again, so every
   key of a done job must be applied.
5. `no_stale_write_accepted` - a worker that woke past its lease (a zombie) had
   no write answered by the destination and no completion acknowledged: its
   lease had expired (the pause is longer than the TTL), so the fence refuses
   whatever it sends. The effects alone cannot show this: a zombie's write that
   lands before the new holder's is the one the new holder gets replayed, and
   the destination's record looks clean.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

INVARIANTS = (
    "no_stale_effect",
    "no_duplicate_effect",
    "completed_exactly_once",
    "effects_of_completed_jobs",
    "no_stale_write_accepted",
)


@dataclass(frozen=True)
class FinalLease:
    """A job's lease as the store holds it at the end (None: never claimed)."""

    state: str
    generation: int
    owner: str


@dataclass
class Findings:
    """What the judge found in a chaos run: each invariant's violations, and how the
    unknown outcomes were settled."""

    violations: dict[str, list[str]] = field(default_factory=lambda: {i: [] for i in INVARIANTS})
    unknown_unapplied: int = 0
    unknown_applied: int = 0

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.violations.values())


def judge(
    *,
    effects: Iterable[Mapping[str, Any]],
    dropped_before: Mapping[str, int],
    jobs: Mapping[str, list[str]],
    final: Mapping[str, FinalLease | None],
    completions: Mapping[str, list[int]],
    confirmed: Mapping[str, int],
    unknown_keys: set[str],
    upstream_idempotent: bool,
    gateways_killed: bool,
    fenced: Mapping[str, int] | None = None,
    stale_accepted: Iterable[str] = (),
) -> Findings:
    """Check the four invariants; `jobs` maps each job to its keys, `final` each job
    to its lease in the store, `completions` each job to the generations whose
    completion the store acknowledged (200) and `confirmed` to a generation whose
    completion answer was lost but which the store shows as done; `stale_accepted`
    says what a zombie sent that was taken."""
    findings = Findings()
    findings.violations["no_stale_write_accepted"].extend(stale_accepted)
    ours = [e for e in sorted(effects, key=lambda e: int(e["seq"])) if e["job_id"] in jobs]
    _stale(ours, findings.violations["no_stale_effect"])
    applied = Counter(str(e["key"]) for e in ours)
    for key, n in sorted(applied.items()):
        if n > 1:
            findings.violations["no_duplicate_effect"].append(f"key {key} applied {n} times")
    for job, keys in jobs.items():
        problems = findings.violations["completed_exactly_once"]
        acked = list(completions.get(job, []))
        if not _completed_once(job, final.get(job), acked, confirmed.get(job), problems):
            continue
        _effects_of(
            job,
            keys,
            applied,
            {**dropped_before, **(fenced or {})},
            unknown_keys,
            findings,
            upstream_idempotent=upstream_idempotent,
            gateways_killed=gateways_killed,
        )
    return findings


def _completed_once(
    job: str,
    lease: FinalLease | None,
    acked: list[int],
    confirmed: int | None,
    problems: list[str],
) -> bool:
    """Check one job's completion; False when the store does not show it done
    (its effects are then not checked)."""
    if lease is None or lease.state != "done":
        state = "never claimed" if lease is None else lease.state
        problems.append(f"job {job} is not completed in the store ({state})")
        return False
    if len(acked) > 1:
        problems.append(f"job {job}: the store acknowledged {len(acked)} completions {acked}")
    done_generation = acked[0] if acked else confirmed
    if done_generation is not None and done_generation != lease.generation:
        problems.append(
            f"job {job}: completion acknowledged for generation {done_generation}, "
            f"store shows done at generation {lease.generation}"
        )
    return True


def _stale(effects: list[Mapping[str, Any]], out: list[str]) -> None:
    highest: dict[str, int] = {}
    for effect in effects:
        job, generation = str(effect["job_id"]), effect["generation"]
        if generation is None:
            out.append(f"job {job}: effect #{effect['seq']} carries no generation")
            continue
        top = highest.get(job, 0)
        if generation < top:
            out.append(
                f"job {job}: generation {generation} applied (#{effect['seq']}, "
                f"key {effect['key']}) after generation {top}"
            )
        highest[job] = max(top, int(generation))


def _effects_of(
    job: str,
    keys: list[str],
    applied: Counter[str],
    dropped_before: Mapping[str, int],
    unknown_keys: set[str],
    findings: Findings,
    *,
    upstream_idempotent: bool,
    gateways_killed: bool,
) -> None:
    out = findings.violations["effects_of_completed_jobs"]
    for key in keys:
        if applied[key]:
            if key in unknown_keys:
                findings.unknown_applied += 1
            continue
        if upstream_idempotent:
            out.append(f"job {job} is done but key {key} was never applied")
        elif key not in unknown_keys:
            out.append(
                f"job {job} is done but key {key} was never applied, "
                "and no worker was told its outcome was unknown"
            )
        elif not dropped_before.get(key) and not gateways_killed:
            out.append(
                f"job {job} is done, key {key} unknown and never applied, "
                "but the destination never dropped it"
            )
        else:
            findings.unknown_unapplied += 1
