/**
 * `@sinkgate/leases/bullmq`: BullMQ jobs run under a lease, writing through the
 * gateway.
 *
 *     const worker = new Worker("orders", fencedProcessor(GATEWAY, async (job, writer, signal) => {
 *       await writer.post("payments", "/charges", { json: job.data, step: "charge" });
 *     }, { ttl: 30 }), { connection });
 *
 * What ends a run becomes BullMQ's idiom, as the Celery and arq adapters do it:
 * the job already completed returns `{ sinkgate: "job_completed", jobId }`
 * (nothing redone); a lease held by another live run moves the job to delayed
 * until it would expire (`DelayedError`: not an attempt); a newer generation
 * elsewhere returns `{ sinkgate: <reason>, jobId }` (the newer run answers for
 * the job); a lease that ran out with nobody else on it, or a lease store that
 * cannot be reached, fails the attempt, so the job's `attempts` and `backoff`
 * decide when it runs again (as Celery's `max_retries` bounds the Python
 * adapter's retries). BullMQ's own cancellation (`worker.cancelJob`, a worker
 * closing) aborts the run's signal and gives the lease back.
 */

import { createHash } from "node:crypto";
import type { Job } from "bullmq";
import { DelayedError } from "bullmq";
import { defaultOwner, LeaseClient } from "./client.js";
import { JobCompleted, LeaseHeld, LeaseLost, StaleWrite, StoreUnavailable } from "./errors.js";
import { hold } from "./hold.js";
import { baseUrl, typeName, validateIdent, validateOptions, validateSeconds, validateTtl } from "./validate.js";
import { FencedWriter, type WriterOptions } from "./writer.js";

export interface FencedProcessorOptions<D = unknown> {
  /** Lease length in seconds (renewed every third of it). */
  readonly ttl: number;
  /** The lease's job id for a BullMQ job (default: the BullMQ job's id). */
  readonly jobId?: (job: Job<D>) => string;
  /** The gateway's lease API, if not the same gateway (`gatewayUrl`). */
  readonly leaseUrl?: string;
  /** The lease API's bearer token (`lease_tokens_env`). */
  readonly leaseToken?: string;
  /** Owner id of this worker (default: host, pid and a random part). */
  readonly owner?: string;
  /** Options of every run's `FencedWriter` (`token`, `wait`, ...). */
  readonly writer?: Omit<WriterOptions, "signal">;
  /** A job whose lease is held elsewhere is looked at again when the holder's
   * lease would expire, or after max(retryDelay, ttl / 3) seconds if that is
   * sooner (default 1). */
  readonly retryDelay?: number;
}

/** What a run returns when the lease says there is nothing (more) for it to do. */
export interface Skipped {
  readonly sinkgate: string;
  readonly jobId: string;
}

/** What a queue should do with a run that ended in an error ("done": skip it). */
export interface Verdict {
  readonly action: "done" | "retry" | "stop";
  readonly reason: string;
  readonly delay: number;
}

const SUPERSEDED = new Set(["stale_generation", "unknown_generation", "owner_mismatch"]);

/** PURE: how a queue treats a run that ended in `error`; undefined: not ours. */
export function verdict(error: unknown, retryDelay = 1): Verdict | undefined {
  if (error instanceof JobCompleted) return { action: "done", reason: "job_completed", delay: 0 };
  if (error instanceof LeaseHeld)
    return { action: "retry", reason: "lease_held", delay: Math.max(error.expiresIn, 0.05) };
  if (error instanceof LeaseLost || error instanceof StaleWrite) {
    if (error.reason === "job_completed") return { action: "done", reason: "job_completed", delay: 0 };
    if (SUPERSEDED.has(error.reason)) return { action: "stop", reason: error.reason, delay: 0 };
    return { action: "retry", reason: error.reason, delay: retryDelay };
  }
  if (error instanceof StoreUnavailable) return { action: "retry", reason: "store_unavailable", delay: retryDelay };
  return undefined;
}

/** A job id from `text`: kept when it is a valid one (1-256 visible ASCII), else
 * a readable prefix and a hash, equally stable (Python's `job_id_from`). */
export function jobIdFrom(text: string): string {
  if (typeof text !== "string") throw new TypeError(`jobIdFrom takes a string, not ${typeName(text)}`);
  if (/^[\x21-\x7e]{1,256}$/.test(text)) return text;
  const digest = createHash("sha256").update(utf8Bytes(text)).digest("hex").slice(0, 32);
  // The first 200 code points, as Python's `text[:200]` (not 200 UTF-16 units).
  let readable = "";
  let count = 0;
  for (const ch of text) {
    if (count++ === 200) break;
    readable += ch >= "\x21" && ch <= "\x7e" ? ch : "_";
  }
  return `${readable}:${digest}`;
}

/** `text`'s UTF-8, a lone surrogate encoded as its own three bytes (Python's
 * "surrogatepass"): Node's UTF-8 would make every lone surrogate U+FFFD, and two
 * different ids one. */
function utf8Bytes(text: string): Buffer {
  if (!/\p{Cs}/u.test(text)) return Buffer.from(text, "utf8");
  const bytes: number[] = [];
  for (const ch of text) {
    const code = ch.codePointAt(0) ?? 0;
    if (code >= 0xd800 && code <= 0xdfff)
      bytes.push(0xe0 | (code >> 12), 0x80 | ((code >> 6) & 0x3f), 0x80 | (code & 0x3f));
    else bytes.push(...Buffer.from(ch, "utf8"));
  }
  return Buffer.from(bytes);
}

/**
 * A BullMQ processor running `processor(job, writer, signal)` under one lease
 * per job: claimed before, renewed while it runs, completed when it returns,
 * released when it throws. A redelivered or duplicated job whose lease is held
 * elsewhere waits (delayed), and one that is done is skipped: it is not run twice.
 */
export function fencedProcessor<D = unknown, R = unknown>(
  gatewayUrl: string,
  processor: (job: Job<D>, writer: FencedWriter, signal: AbortSignal) => Promise<R>,
  options: FencedProcessorOptions<D>,
): (job: Job<D>, token?: string, signal?: AbortSignal) => Promise<R | Skipped> {
  // Every option checked here, not at each job's run (where each would fail the job).
  if (typeof processor !== "function") throw new TypeError("processor must be a function");
  validateOptions(options, "options");
  const ttl = validateTtl(options.ttl);
  const retryDelay = validateSeconds(options.retryDelay ?? 1, "retryDelay");
  baseUrl(gatewayUrl, "gatewayUrl");
  if (options.leaseUrl !== undefined) baseUrl(options.leaseUrl, "leaseUrl"); // named as the caller wrote it
  const client = new LeaseClient(options.leaseUrl ?? gatewayUrl, { token: options.leaseToken });
  const owner = options.owner === undefined ? defaultOwner() : validateIdent(options.owner, "owner");
  if (options.jobId !== undefined && typeof options.jobId !== "function") {
    throw new TypeError(`jobId must be a function, not ${typeName(options.jobId)}`);
  }
  const name = options.jobId ?? ((job: Job<D>) => String(job.id));
  // The writer's options, as every run's writer will take them.
  new FencedWriter(gatewayUrl, CHECK_LEASE, { ...options.writer });

  // Three parameters: BullMQ then gives the run an AbortSignal of its own
  // (`worker.cancelJob`, the worker closing), which stops the body and gives
  // the lease back as a worker's shutdown does.
  return async (job: Job<D>, token?: string, signal?: AbortSignal): Promise<R | Skipped> => {
    const jobId = jobIdFrom(name(job));
    try {
      return await hold(client, jobId, { owner, ttl, signal }, (lease, leaseSignal) =>
        processor(job, new FencedWriter(gatewayUrl, lease, { ...options.writer, signal: leaseSignal }), leaseSignal),
      );
    } catch (error) {
      const found = await settle(client, error, jobId, ttl, retryDelay);
      if (found === undefined) throw error;
      if (found.action !== "retry") return { sinkgate: found.reason, jobId };
      // Only a lease held by another live run waits without using an attempt: a
      // lost lease or an unreachable store fails the attempt, so `attempts` and
      // `backoff` bound it (delayed for free, a dead store looped for ever).
      if (found.reason !== "lease_held") throw error;
      await job.moveToDelayed(Date.now() + Math.ceil(found.delay * 1000), token);
      throw new DelayedError(`sinkgate: ${found.reason}, retried in ${found.delay}s`);
    }
  };
}

/** A lease of the right shape, to check the writer's options against. */
const CHECK_LEASE = {
  jobId: "check",
  owner: "check",
  generation: 1,
  state: "active",
  leaseUntil: new Date(0),
  expiresIn: 0,
} as const;

/** `verdict`, asking the store who holds the job when the error alone cannot
 * tell (a lease that expired locally may or may not have been taken). */
async function settle(
  client: LeaseClient,
  error: unknown,
  jobId: string,
  ttl: number,
  retryDelay: number,
): Promise<Verdict | undefined> {
  const found = verdict(error, retryDelay);
  if (error instanceof LeaseHeld && found !== undefined) {
    // The holder renews every third of the ttl: look again at about that pace.
    return { ...found, delay: Math.min(found.delay, Math.max(retryDelay, ttl / 3)) };
  }
  if (found === undefined || found.action !== "retry") return found;
  let current: Awaited<ReturnType<LeaseClient["get"]>>;
  try {
    current = await client.get(jobId);
  } catch {
    return found;
  }
  const mine = error instanceof LeaseLost || error instanceof StaleWrite ? error.generation : undefined;
  if (current?.state === "done") return { action: "done", reason: "job_completed", delay: 0 };
  if (current !== null && mine !== undefined && current.generation > mine) {
    return { action: "stop", reason: "stale_generation", delay: 0 };
  }
  return found;
}
