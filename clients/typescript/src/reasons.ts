/**
 * The contract's reason codes that a worker branches on, and the families the
 * writer's exceptions are made of. Mirrors `leases/reasons.py` (the table of
 * SPEC 2, 3 and 4); `test/reasons.test.ts` checks the two agree.
 */

export type Family = "request" | "fence" | "idempotency" | "upstream" | "gateway";

export interface ReasonInfo {
  readonly status: number;
  readonly family: Family;
  /** Kept in the gateway's rejection log. */
  readonly recorded: boolean;
  /** Answered with `Retry-After`: the same write may succeed later. */
  readonly retryLater: boolean;
}

function info(status: number, family: Family, recorded = false, retryLater = false): ReasonInfo {
  return { status, family, recorded, retryLater };
}

/** Every reason code of the contract, in SPEC 2's order of checks. */
export const REASONS: Readonly<Record<string, ReasonInfo>> = Object.freeze({
  unknown_destination: info(404, "request"),
  method_not_allowed: info(405, "request"),
  unauthorized: info(401, "request", true),
  body_too_large: info(413, "request"),
  request_timeout: info(408, "request"),
  missing_fencing_token: info(400, "request", true),
  invalid_fencing_token: info(400, "request", true),
  missing_idempotency_key: info(400, "request", true),
  invalid_idempotency_key: info(400, "request", true),
  invalid_path: info(400, "request"),
  invalid_request: info(400, "request"),
  not_found: info(404, "request"),
  invalid_config: info(400, "request"),
  lease_not_held: info(409, "fence", true),
  stale_generation: info(409, "fence", true),
  unknown_generation: info(409, "fence", true),
  job_completed: info(409, "fence", true),
  lease_expired: info(409, "fence", true),
  owner_mismatch: info(409, "fence", true),
  lease_held: info(409, "fence", false, true),
  older_generation_in_flight: info(409, "fence", true, true),
  idempotency_key_reused: info(422, "idempotency", true),
  request_in_progress: info(409, "idempotency", true, true),
  outcome_unknown: info(409, "idempotency", true),
  duplicate: info(200, "idempotency", true),
  key_not_unknown: info(409, "idempotency"),
  attempt_mismatch: info(409, "idempotency"),
  upstream_unreachable: info(502, "upstream"),
  upstream_disconnected: info(502, "upstream"),
  upstream_timeout: info(504, "upstream"),
  store_unavailable: info(503, "gateway", false, true),
  overloaded: info(503, "gateway", false, true),
  internal_error: info(500, "gateway"),
});

/**
 * What renew, complete and release (and a lease-mode fence) can be refused for,
 * in the contract's order (SPEC 2 step 6).
 */
export const LOST_REASONS: readonly string[] = Object.freeze(
  Object.entries(REASONS)
    .filter(([, r]) => r.family === "fence" && r.recorded && !r.retryLater)
    .map(([reason]) => reason),
);

/** The client's own reasons when the gateway cannot be reached or does not answer. */
export const GATEWAY_UNREACHABLE = "gateway_unreachable";
export const GATEWAY_TIMEOUT = "gateway_timeout";

/** The reasons a write is retried for (honouring `Retry-After`), as the Python writer does. */
export const RETRIED_REASONS: ReadonlySet<string> = new Set(["older_generation_in_flight", "request_in_progress"]);
