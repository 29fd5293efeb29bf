/**
 * The errors a worker branches on, each carrying the contract's reason code.
 *
 * Two roots, as on the Python side: `LeaseError` for the lease API (claim,
 * renew, complete, release, `hold`) and `GatewayRejected` for the write route,
 * with one subclass per family (`StaleWrite`, `DuplicateWrite`, `BadWrite`,
 * `GatewayUnavailable`). Bad arguments are `TypeError`/`RangeError`.
 */

import { GATEWAY_TIMEOUT, GATEWAY_UNREACHABLE, REASONS } from "./reasons.js";

/** A problem+json body (RFC 9457) as the gateway sends it. */
export type Problem = Readonly<Record<string, unknown>>;

/** What the lease API's answer said besides the reason, where it answered. */
export interface LeaseErrorFields {
  readonly status?: number | undefined;
  readonly detail?: string | undefined;
  readonly problem?: Problem | undefined;
  /** The answer's `Retry-After`, in seconds. */
  readonly retryAfter?: number | undefined;
  /** What failed underneath (fetch's error, whose own `cause` says why). */
  readonly cause?: unknown;
}

/** Root of every lease error; `reason` is the contract's reason code, and
 * `status`, `detail`, `problem` and `retryAfter` the gateway's answer where
 * there was one (undefined, "", {} and undefined for what the worker decided
 * itself, such as its own clock's `lease_expired`). */
export class LeaseError extends Error {
  readonly reason: string;
  readonly status: number | undefined;
  readonly detail: string;
  readonly problem: Problem;
  /** Seconds the gateway asked to wait before calling again (`Retry-After`), where it did. */
  readonly retryAfter: number | undefined;

  constructor(message: string, reason: string, fields: LeaseErrorFields = {}) {
    super(message, fields.cause === undefined ? undefined : { cause: fields.cause });
    this.name = new.target.name;
    this.reason = reason;
    this.status = fields.status;
    this.detail = fields.detail ?? "";
    this.problem = fields.problem ?? {};
    this.retryAfter = fields.retryAfter;
  }
}

/** The job is claimed by a live lease (`owner`, for `expiresIn` more seconds). */
export class LeaseHeld extends LeaseError {
  readonly jobId: string;
  readonly owner: string;
  readonly expiresIn: number;
  readonly currentGeneration: number | undefined;

  constructor(
    jobId: string,
    owner: string,
    expiresIn: number,
    currentGeneration?: number,
    retryAfter?: number,
    fields?: LeaseErrorFields,
  ) {
    super(
      `job ${JSON.stringify(jobId)} is held by ${JSON.stringify(owner)} for ${expiresIn.toFixed(3)}s more`,
      "lease_held",
      { ...fields, retryAfter: retryAfter ?? fields?.retryAfter },
    );
    this.jobId = jobId;
    this.owner = owner;
    this.expiresIn = expiresIn;
    this.currentGeneration = currentGeneration;
  }
}

/** The job is done and can never be claimed again. */
export class JobCompleted extends LeaseError {
  readonly jobId: string;
  /** The generation that completed the job, where the answer says it. */
  readonly currentGeneration: number | undefined;

  constructor(jobId: string, fields?: LeaseErrorFields, currentGeneration?: number) {
    super(`job ${JSON.stringify(jobId)} is completed`, "job_completed", fields);
    this.jobId = jobId;
    this.currentGeneration = currentGeneration;
  }
}

/**
 * A renewal, completion or release found the lease no longer held; or `hold`'s
 * own clock said it may be gone (`lease_expired`), or the store could not be
 * reached before that (`store_unavailable`).
 */
export class LeaseLost extends LeaseError {
  readonly jobId: string;
  readonly generation: number;
  readonly currentGeneration: number | undefined;

  constructor(
    jobId: string,
    generation: number,
    reason: string,
    currentGeneration?: number,
    fields?: LeaseErrorFields,
  ) {
    super(`lease on ${JSON.stringify(jobId)} generation ${generation} lost: ${reason}`, reason, fields);
    this.jobId = jobId;
    this.generation = generation;
    this.currentGeneration = currentGeneration;
  }
}

/** The lease API could not be reached or gave no clear answer; the call may be retried. */
export class StoreUnavailable extends LeaseError {
  constructor(message: string, fields?: LeaseErrorFields) {
    super(message, "store_unavailable", fields);
  }
}

export interface RejectionFields {
  readonly status?: number | undefined;
  readonly detail?: string | undefined;
  readonly jobId?: string | undefined;
  readonly generation?: number | undefined;
  readonly currentGeneration?: number | undefined;
  readonly highestGeneration?: number | undefined;
  readonly rejectionId?: number | undefined;
  readonly retryAfter?: number | undefined;
  /** What failed underneath (fetch's error, whose own `cause` says why). */
  readonly cause?: unknown;
  readonly problem?: Problem | undefined;
}

/** The gateway refused the write itself (its answer carried `Sinkgate-Rejected`). */
export class GatewayRejected extends Error {
  readonly reason: string;
  readonly status: number | undefined;
  readonly detail: string;
  readonly jobId: string | undefined;
  readonly generation: number | undefined;
  readonly currentGeneration: number | undefined;
  readonly highestGeneration: number | undefined;
  readonly rejectionId: number | undefined;
  /** Seconds, from the answer's `Retry-After` (delta-seconds only). */
  readonly retryAfter: number | undefined;
  readonly problem: Problem;

  constructor(reason: string, fields: RejectionFields = {}) {
    const head = `${fields.status ?? "-"} ${reason}`;
    super(
      fields.detail ? `${head}: ${fields.detail}` : head,
      fields.cause === undefined ? undefined : { cause: fields.cause },
    );
    this.name = new.target.name;
    this.reason = reason;
    this.status = fields.status;
    this.detail = fields.detail ?? "";
    this.jobId = fields.jobId;
    this.generation = fields.generation;
    this.currentGeneration = fields.currentGeneration;
    this.highestGeneration = fields.highestGeneration;
    this.rejectionId = fields.rejectionId;
    this.retryAfter = fields.retryAfter;
    this.problem = fields.problem ?? {};
  }
}

/** The write's lease is not the job's current one: stop, another worker has it. */
export class StaleWrite extends GatewayRejected {}

/** The key is taken: reused with another payload, in flight, of unknown outcome,
 * or an older generation of the job is still on the wire. */
export class DuplicateWrite extends GatewayRejected {}

/** The request itself is wrong (route, method, auth, size, headers, path). */
export class BadWrite extends GatewayRejected {}

/** The gateway, its store or the upstream could not be reached; the write may be
 * retried with the same key (the gateway keeps at most one effect per key). */
export class GatewayUnavailable extends GatewayRejected {}

type Rejection = new (reason: string, fields?: RejectionFields) => GatewayRejected;

function familyOf(reason: string): Rejection | undefined {
  if (reason === GATEWAY_UNREACHABLE || reason === GATEWAY_TIMEOUT) return GatewayUnavailable;
  const found = REASONS[reason];
  if (found === undefined || reason === "lease_held") return undefined;
  switch (found.family) {
    case "fence":
      // a fence refusal is final for this lease; the barrier is "not yet"
      return found.retryLater ? DuplicateWrite : StaleWrite;
    case "idempotency":
      return reason === "duplicate" ? undefined : DuplicateWrite;
    case "upstream":
    case "gateway":
      return reason === "internal_error" ? undefined : GatewayUnavailable;
    default:
      return undefined; // request-shape reasons are classified by status
  }
}

function str(value: unknown): string | undefined {
  return typeof value === "string" ? value : undefined;
}

function int(value: unknown): number | undefined {
  return typeof value === "number" && Number.isInteger(value) ? value : undefined;
}

/** Delta-seconds only; an HTTP-date falls back to the writer's own backoff. */
export function parseRetryAfter(value: string | null): number | undefined {
  if (value === null) return undefined;
  const trimmed = value.trim();
  return /^[0-9]+$/.test(trimmed) ? Number(trimmed) : undefined;
}

/** Parse a body as a JSON object; anything else is `undefined`. */
export function parseObject(body: Uint8Array | string): Problem | undefined {
  try {
    const text = typeof body === "string" ? body : new TextDecoder().decode(body);
    const doc: unknown = JSON.parse(text);
    return doc !== null && typeof doc === "object" && !Array.isArray(doc) ? (doc as Problem) : undefined;
  } catch {
    return undefined;
  }
}

/** The typed error for a gateway answer carrying `Sinkgate-Rejected`. */
export function rejectionFromResponse(status: number, headers: Headers, body: Uint8Array): GatewayRejected {
  const problem = parseObject(body) ?? {};
  const reason = headers.get("Sinkgate-Rejected") || str(problem.reason) || "unknown";
  const family = familyOf(reason) ?? (status >= 500 ? GatewayUnavailable : BadWrite);
  return new family(reason, {
    status,
    detail: str(problem.detail) ?? "",
    jobId: str(problem.job_id),
    generation: int(problem.generation),
    currentGeneration: int(problem.current_generation),
    highestGeneration: int(problem.highest_generation),
    rejectionId: int(problem.rejection_id),
    retryAfter: parseRetryAfter(headers.get("Retry-After")),
    problem,
  });
}
