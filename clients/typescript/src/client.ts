/**
 * The lease API of SPEC 3 over HTTP: claim, renew, complete, release, get.
 *
 * Every failure to get a clear answer (a connection error, a timeout, a 5xx, an
 * answer this client does not understand) is `StoreUnavailable`, so `hold`
 * treats it as a failed renewal and keeps trying until the worker's own
 * deadline - as `leases.http.HTTPLeaseStore` does.
 */

import { randomBytes } from "node:crypto";
import http from "node:http";
import https from "node:https";
import { hostname } from "node:os";
import { bounded, networkWords } from "./abort.js";
import {
  JobCompleted,
  type LeaseErrorFields,
  LeaseHeld,
  LeaseLost,
  type Problem,
  parseObject,
  parseRetryAfter,
  StoreUnavailable,
} from "./errors.js";
import { LOST_REASONS } from "./reasons.js";
import {
  baseUrl,
  validateGeneration,
  validateIdent,
  validateOptions,
  validateSeconds,
  validateSignal,
  validateTtl,
  validateVisible,
} from "./validate.js";

export type LeaseState = "free" | "active" | "done";

/** A lease as the store gave it (immutable). */
export interface Lease {
  readonly jobId: string;
  readonly owner: string;
  readonly generation: number;
  readonly state: LeaseState;
  readonly leaseUntil: Date;
  /** Seconds left by the store's clock when it answered; 0 unless active. */
  readonly expiresIn: number;
}

/** Which lease a renew/complete/release names. */
export type LeaseRef = Pick<Lease, "jobId" | "owner" | "generation">;

export interface LeaseClientOptions {
  /** Bearer token for a gateway whose lease API requires one (`lease_tokens_env`). */
  readonly token?: string | undefined;
  /** Seconds each call may take (default 10). */
  readonly timeout?: number;
}

export interface CallOptions {
  /** Aborts the call; it then rejects with the signal's reason. */
  readonly signal?: AbortSignal | undefined;
}

/** An owner id unique to this process lifetime: host, pid and a random part
 * (the shape of the Python side's `default_owner`). */
export function defaultOwner(): string {
  const host =
    hostname()
      .replace(/[^\x21-\x7e]/g, "_")
      .slice(0, 64) || "host";
  return `${host}:${process.pid}:${randomBytes(4).toString("hex")}`;
}

export class LeaseClient {
  readonly url: string;
  readonly #headers: Record<string, string>;
  readonly #timeout: number;

  constructor(gatewayUrl: string, options: LeaseClientOptions = {}) {
    this.url = baseUrl(gatewayUrl, "gatewayUrl");
    this.#timeout = validateSeconds(options.timeout ?? 10, "timeout", true);
    this.#headers = { Accept: "application/json" };
    if (options.token !== undefined) {
      this.#headers.Authorization = `Bearer ${validateVisible(options.token, "token")}`;
    }
  }

  /** Claim `jobId`; throws `LeaseHeld` (with the holder) or `JobCompleted`. */
  async claim(jobId: string, options: { owner?: string | undefined; ttl: number } & CallOptions): Promise<Lease> {
    validateIdent(jobId, "jobId");
    validateOptions(options, "options");
    const owner = validateIdent(options.owner ?? defaultOwner(), "owner");
    const ttl = validateTtl(options.ttl);
    const answer = await this.#call("POST", jobId, "claim", { owner, ttl }, options.signal);
    if (answer.status === 200) return toLease(answer.doc, answer.status);
    const reason = answer.doc.reason;
    if (reason === "lease_held") {
      const { owner: holder, expires_in: expiresIn, current_generation: current } = answer.doc;
      if (typeof holder === "string" && typeof expiresIn === "number") {
        const generation = isInt(current) ? current : undefined;
        throw new LeaseHeld(jobId, holder, expiresIn, generation, answer.retryAfter, sent(answer));
      }
    } else if (reason === "job_completed") {
      const current = answer.doc.current_generation;
      throw new JobCompleted(jobId, sent(answer), isInt(current) ? current : undefined);
    }
    throw unexpected(answer, this.url);
  }

  /** Extend the lease (by `ttl`, or the lease's own ttl); throws `LeaseLost`. */
  async renew(lease: LeaseRef, options: { ttl?: number | undefined } & CallOptions = {}): Promise<Lease> {
    // async, as every call: a bad argument is a rejected promise, never a synchronous throw
    const given = validateOptions(options ?? {}, "options"); // null: none, as before
    const ttl = given.ttl === undefined ? undefined : validateTtl(given.ttl);
    return this.#held("renew", lease, ttl, given.signal);
  }

  /** Mark the job done (it can never be claimed again); throws `LeaseLost`. */
  async complete(lease: LeaseRef, options: CallOptions = {}): Promise<Lease> {
    return this.#held("complete", lease, undefined, validateOptions(options ?? {}, "options").signal);
  }

  /** Free the job for another claim now; throws `LeaseLost`. */
  async release(lease: LeaseRef, options: CallOptions = {}): Promise<Lease> {
    return this.#held("release", lease, undefined, validateOptions(options ?? {}, "options").signal);
  }

  /** The job's lease, or null when it was never claimed. */
  async get(jobId: string, options: CallOptions = {}): Promise<Lease | null> {
    validateIdent(jobId, "jobId");
    const given = validateOptions(options ?? {}, "options");
    const answer = await this.#call("GET", jobId, undefined, undefined, given.signal);
    if (answer.status === 200) return toLease(answer.doc, answer.status);
    if (answer.status === 404 && answer.doc.reason === "lease_not_held") return null;
    throw unexpected(answer, this.url);
  }

  async #held(op: string, lease: LeaseRef, ttl: number | undefined, signal: AbortSignal | undefined): Promise<Lease> {
    if (lease === null || typeof lease !== "object") throw new TypeError("lease must be a Lease");
    const jobId = validateIdent(lease.jobId, "jobId");
    const owner = validateIdent(lease.owner, "owner");
    const generation = validateGeneration(lease.generation);
    const body: Record<string, unknown> = { owner, generation };
    if (ttl !== undefined) body.ttl = ttl;
    const answer = await this.#call("POST", jobId, op, body, signal);
    if (answer.status === 200) return toLease(answer.doc, answer.status);
    const reason = answer.doc.reason;
    if (answer.status === 409 && typeof reason === "string" && LOST_REASONS.includes(reason)) {
      const current = answer.doc.current_generation;
      throw new LeaseLost(jobId, generation, reason, isInt(current) ? current : undefined, sent(answer));
    }
    throw unexpected(answer, this.url);
  }

  async #call(
    method: string,
    jobId: string,
    op: string | undefined,
    body: Record<string, unknown> | undefined,
    signal: AbortSignal | undefined,
  ): Promise<{ status: number; doc: Problem; retryAfter: number | undefined }> {
    validateSignal(signal, "signal");
    let segment = encodeURIComponent(jobId);
    // fetch's URL parser reads %2E as "." and resolves dot segments ("/leases/%2E%2E/claim"
    // would be POST /claim): these two go out through node:http, their path as written.
    const verbatim = segment === "." || segment === "..";
    if (verbatim) segment = segment.replaceAll(".", "%2E");
    const path = `/leases/${segment}${op === undefined ? "" : `/${op}`}`;
    const headers: Record<string, string> = { ...this.#headers };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const payload = body === undefined ? undefined : JSON.stringify(body);
    const deadline = bounded(signal, this.#timeout);
    let answer: Answer;
    try {
      const send = verbatim ? sendVerbatim : sendFetch;
      answer = await send(this.url, path, method, headers, payload, deadline.signal);
    } catch (error) {
      if (signal?.aborted) throw signal.reason;
      const why = deadline.timedOut() ? "timed out" : `failed: ${networkWords(error)}`;
      throw new StoreUnavailable(`lease API ${method} ${path} ${why}`, { cause: error });
    } finally {
      deadline.done();
    }
    const { status, raw } = answer;
    const retryAfter = parseRetryAfter(answer.retryAfter);
    const doc = parseObject(raw);
    if (status >= 500) {
      const fields = doc === undefined ? { status, retryAfter } : sent({ status, doc, retryAfter });
      throw new StoreUnavailable(`lease API ${method} ${path} answered ${status}`, fields);
    }
    if (doc === undefined) {
      // The status stays on the error: a 401 or 403 from a proxy in front says the
      // configuration is wrong, whatever body it came with.
      throw new StoreUnavailable(
        `lease API ${method} ${path} answered ${status} without a JSON object: ${notTheLeaseApi(this.url)}`,
        { status, retryAfter },
      );
    }
    return { status, doc, retryAfter };
  }
}

interface Answer {
  readonly status: number;
  readonly retryAfter: string | null;
  readonly raw: Uint8Array;
}

async function sendFetch(
  base: string,
  path: string,
  method: string,
  headers: Record<string, string>,
  body: string | undefined,
  signal: AbortSignal,
): Promise<Answer> {
  const init: RequestInit = { method, headers, signal };
  if (body !== undefined) init.body = body;
  const resp = await fetch(base + path, init);
  const retryAfter = resp.headers.get("Retry-After");
  return { status: resp.status, retryAfter, raw: new Uint8Array(await resp.arrayBuffer()) };
}

/** One request with `path` sent exactly as written (node:http does not parse it). */
function sendVerbatim(
  base: string,
  path: string,
  method: string,
  headers: Record<string, string>,
  body: string | undefined,
  signal: AbortSignal,
): Promise<Answer> {
  const url = new URL(base);
  const transport = url.protocol === "https:" ? https : http;
  const sent = body === undefined ? undefined : Buffer.from(body, "utf8");
  const options: http.RequestOptions = {
    hostname: url.hostname.replace(/^\[(.*)\]$/, "$1"),
    port: url.port || undefined,
    path: url.pathname.replace(/\/$/, "") + path,
    method,
    headers: sent === undefined ? headers : { ...headers, "Content-Length": String(sent.length) },
    signal,
  };
  return new Promise((resolve, reject) => {
    const request = transport.request(options, (response) => {
      const chunks: Buffer[] = [];
      response.on("data", (chunk: Buffer) => chunks.push(chunk));
      response.on("error", reject);
      response.on("close", () => {
        if (!response.complete) reject(new Error("the connection closed before the answer ended"));
      });
      response.on("end", () => {
        const retryAfter = response.headers["retry-after"];
        resolve({
          status: response.statusCode ?? 0,
          retryAfter: typeof retryAfter === "string" ? retryAfter : null,
          raw: new Uint8Array(Buffer.concat(chunks)),
        });
      });
    });
    request.on("error", reject);
    request.end(sent);
  });
}

function isInt(value: unknown): value is number {
  return typeof value === "number" && Number.isInteger(value);
}

/** The answer's status, detail and problem+json body, for a lease error. */
function sent(answer: { status: number; doc: Problem; retryAfter?: number | undefined }): LeaseErrorFields {
  const detail = answer.doc.detail;
  return {
    status: answer.status,
    detail: typeof detail === "string" ? detail : "",
    problem: answer.doc,
    retryAfter: answer.retryAfter,
  };
}

/** Where to look when an answer is no lease API's: most often the URL is the
 * admin listener's or an upstream's. */
function notTheLeaseApi(url: string): string {
  return `is ${url} the gateway's main listener (its [server] listen), not the admin listener or an upstream?`;
}

function unexpected(answer: { status: number; doc: Problem; retryAfter: number | undefined }, url: string): Error {
  const { status, doc } = answer;
  const reason = typeof doc.reason === "string" ? doc.reason : "";
  // The answer goes along: a wrong lease token (401) is told from an outage by `status` and `problem`.
  const fields = sent(answer);
  const detail = fields.detail;
  if (status === 400 && reason === "invalid_request") {
    // The gateway validated what this client should already have: as if local.
    return new RangeError(detail || "invalid request");
  }
  if (reason === "store_unavailable")
    return new StoreUnavailable(`the gateway's store is unavailable: ${detail}`, fields);
  if (reason === "" || reason === "not_found")
    return new StoreUnavailable(`unexpected answer ${status} to a lease API call: ${notTheLeaseApi(url)}`, fields);
  return new StoreUnavailable(`unexpected lease API answer ${status} ${reason}: ${detail}`, fields);
}

/** A lease object of SPEC 3 -> `Lease`; anything malformed is `StoreUnavailable`. */
function toLease(doc: Problem, status: number): Lease {
  try {
    const state = doc.state;
    if (state !== "free" && state !== "active" && state !== "done")
      throw new RangeError(`unknown state ${String(state)}`);
    const until = doc.lease_until;
    // RFC 3339 has an offset: without one, Date would read the time as local
    const zoned = typeof until === "string" && /(?:Z|[+-]\d\d:\d\d)$/i.test(until);
    const leaseUntil = zoned ? new Date(until) : new Date(Number.NaN);
    if (Number.isNaN(leaseUntil.getTime())) throw new RangeError("lease_until must be an RFC 3339 time");
    const expiresIn = doc.expires_in;
    if (typeof expiresIn !== "number" || !(Number.isFinite(expiresIn) && expiresIn >= 0)) {
      throw new RangeError("expires_in must be a non-negative number");
    }
    return Object.freeze({
      jobId: validateIdent(doc.job_id, "job_id"),
      owner: validateIdent(doc.owner, "owner"),
      generation: validateGeneration(doc.generation),
      state,
      leaseUntil,
      expiresIn,
    });
  } catch (error) {
    throw new StoreUnavailable(`malformed lease from the lease API: ${String(error)}`, { status });
  }
}
