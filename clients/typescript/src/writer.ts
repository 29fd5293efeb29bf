/**
 * Fenced writes from a worker: every request goes through the gateway's
 * `/to/{destination}/...` route with the lease's fencing headers, an
 * idempotency key and `Prefer: wait`, as `leases.writer.FencedWriter` sends them.
 *
 * Gateway refusals (answers carrying `Sinkgate-Rejected`) throw one error per
 * family; upstream answers come back untouched as a `WriteResult`. Bound to a
 * `hold`'s signal, the writer refuses to send once the lease may be gone and
 * cuts a request in flight when that happens.
 */

import { bounded, networkWords, sleep } from "./abort.js";
import type { Lease } from "./client.js";
import { GatewayUnavailable, parseObject, rejectionFromResponse } from "./errors.js";
import type { HeldLease } from "./hold.js";
import { canonicalJson } from "./json.js";
import { deriveKey, validateKey } from "./key.js";
import { appliedWait, MAX_VALUE, readPreferences, strip } from "./prefer.js";
import { GATEWAY_TIMEOUT, GATEWAY_UNREACHABLE, RETRIED_REASONS } from "./reasons.js";
import { entries, type Query, writeTarget } from "./target.js";
import {
  baseUrl,
  typeName,
  validateGeneration,
  validateIdent,
  validateOptions,
  validateSeconds,
  validateSignal,
  validateVisible,
} from "./validate.js";

/** The upstream's answer as the gateway relayed (or replayed) it. */
export interface WriteResult {
  readonly status: number;
  readonly headers: Headers;
  readonly body: Uint8Array;
  /** The gateway answered from its record (`Idempotent-Replayed: true`). */
  readonly replayed: boolean;
  json(): unknown;
  text(): string;
}

export interface WriterOptions {
  /** Once aborted, nothing is sent and a request in flight is cut (a worker's
   * shutdown, say). A `HeldLease`'s own signal is heeded as well, always. */
  readonly signal?: AbortSignal | undefined;
  /** The destination's worker token (`Authorization: Bearer`). */
  readonly token?: string | undefined;
  /** Retries of `request_in_progress` / `older_generation_in_flight` (default 5). */
  readonly maxRetries?: number;
  /** Longest wait between two retries, seconds (default 5). */
  readonly maxRetryWait?: number;
  /** Seconds one request may take, answer included (default 60). */
  readonly timeout?: number;
  /** `Prefer: wait=N` sent with every write (default 5; 0: not sent). */
  readonly wait?: number;
}

export interface WriteOptions {
  /** A JSON body, sent as Python's writer sends it (sorted keys, compact, ASCII). */
  readonly json?: unknown;
  /** A raw body; a string is sent as `text/plain; charset=utf-8`. */
  readonly body?: Uint8Array | string | undefined;
  /** An object of names and values, a `Headers` or a `Map`. */
  readonly headers?: Readonly<Record<string, string>> | Headers | ReadonlyMap<string, string> | undefined;
  /** Names and values for the query, spelled as the Python writer spells its `params`. */
  readonly query?: Query | undefined;
  /** The job's step: the key is `deriveKey(jobId, step)`, the same in every run. */
  readonly step?: string | undefined;
  /** An explicit idempotency key instead of `step`. */
  readonly key?: string | undefined;
}

const OWN_HEADERS = new Set(["fencing-job", "fencing-token", "fencing-owner", "idempotency-key", "authorization"]);
// The connection's and the body's framing, the HTTP client's to set: fetch throws for all but
// Content-Length (which hangs or cuts the request when it is not the body's length). Refused
// alike in both writers, before anything is sent, rather than as a retryable GatewayUnavailable.
const CONNECTION_HEADERS = new Set([
  "connection",
  "content-length",
  "expect",
  "keep-alive",
  "transfer-encoding",
  "upgrade",
]);
const METHOD = /^[A-Za-z]+$/;
// Methods the platform's fetch refuses to send (a TypeError of its own, which
// would read as the gateway being unreachable), and those that carry no body.
const FORBIDDEN_METHODS = new Set(["CONNECT", "TRACE", "TRACK"]);
const BODILESS_METHODS = new Set(["GET", "HEAD"]);
// biome-ignore lint/suspicious/noControlCharactersInRegex: control characters are what it finds
const CONTROL = /[\x00-\x1f\x7f]/;
// Header names and values a request can carry (undici sends a value's U+0080-U+00FF as
// Latin-1 bytes, which the gateway refuses: ASCII only).
const TOKEN = /^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$/;
// biome-ignore lint/suspicious/noControlCharactersInRegex: what a header value cannot carry
const UNSENDABLE = /[\x00-\x08\x0a-\x1f\x7f]|[^\x00-\x7f]/;

export class FencedWriter {
  readonly #base: string;
  readonly #lease: Lease | HeldLease;
  /** The `HeldLease`'s signal, then the caller's: any of them stops the writer. */
  readonly #signals: readonly AbortSignal[];
  readonly #token: string | undefined;
  readonly #maxRetries: number;
  readonly #maxRetryWait: number;
  readonly #timeout: number;
  readonly #prefer: string | undefined;

  constructor(gatewayUrl: string, lease: Lease | HeldLease, options: WriterOptions = {}) {
    this.#base = baseUrl(gatewayUrl, "gatewayUrl");
    if (lease === null || typeof lease !== "object")
      throw new TypeError(`lease must be a Lease, not ${typeName(lease)}`);
    validateIdent(lease.jobId, "lease.jobId");
    validateIdent(lease.owner, "lease.owner");
    validateGeneration(lease.generation);
    this.#lease = lease;
    validateOptions(options, "options");
    validateSignal(options.signal, "signal");
    // The caller's signal adds to the hold's, never replaces it: a writer given a
    // shutdown signal under a hold still stops the moment the lease may be gone.
    const held = "signal" in lease && lease.signal instanceof AbortSignal ? lease.signal : undefined;
    this.#signals = [held, options.signal].filter(
      (signal, i, all): signal is AbortSignal => signal !== undefined && all.indexOf(signal) === i,
    );
    this.#token = options.token === undefined ? undefined : validateVisible(options.token, "token");
    const maxRetries = options.maxRetries ?? 5;
    if (!Number.isInteger(maxRetries) || maxRetries < 0) throw new RangeError("maxRetries must be an integer >= 0");
    this.#maxRetries = maxRetries;
    this.#maxRetryWait = validateSeconds(options.maxRetryWait ?? 5, "maxRetryWait");
    this.#timeout = validateSeconds(options.timeout ?? 60, "timeout", true);
    const wait = options.wait ?? 5;
    if (!Number.isInteger(wait) || wait < 0) throw new RangeError("wait must be a whole number of seconds >= 0");
    this.#prefer = wait > 0 ? `wait=${wait}` : undefined;
  }

  /** The lease the next write is fenced with (a hold's latest renewal). */
  get lease(): Lease {
    return this.#lease;
  }

  post(destination: string, path: string, options: WriteOptions): Promise<WriteResult> {
    return this.request("POST", destination, path, options);
  }

  put(destination: string, path: string, options: WriteOptions): Promise<WriteResult> {
    return this.request("PUT", destination, path, options);
  }

  patch(destination: string, path: string, options: WriteOptions): Promise<WriteResult> {
    return this.request("PATCH", destination, path, options);
  }

  delete(destination: string, path: string, options: WriteOptions): Promise<WriteResult> {
    return this.request("DELETE", destination, path, options);
  }

  /**
   * Send one write; retry while an older generation or the same key is in
   * flight (at most `maxRetries` times): at once after an answer the gateway
   * held (`Preference-Applied`), counted as a retry once such holds add up to
   * the `Retry-After` (at most `maxRetryWait`) it would have slept; else after
   * its `Retry-After`.
   *
   * Rejects with the hold's `LeaseLost` once the lease may be gone (before
   * sending, or cutting the request in flight), `GatewayRejected` subclasses
   * for the gateway's refusals, `TypeError`/`RangeError` for bad arguments.
   */
  async request(method: string, destination: string, path: string, options: WriteOptions): Promise<WriteResult> {
    validateOptions(options, "options");
    const url = this.#url(method, destination, path, options.query);
    if ((options.key === undefined) === (options.step === undefined)) {
      throw new TypeError("pass exactly one of key and step");
    }
    const key =
      options.key !== undefined ? validateKey(options.key) : deriveKey(this.#lease.jobId, options.step as string);
    const [body, contentType] = encodeBody(options);
    if (body !== undefined && BODILESS_METHODS.has(method.toUpperCase())) {
      throw new TypeError(`fetch cannot send a body with ${method}`);
    }
    const headers = this.#headers(options.headers, contentType, key);
    let retries = 0;
    let held = 0; // seconds the gateway held the write since the last retry counted
    for (;;) {
      this.#check();
      const lease = this.#lease;
      headers["Fencing-Job"] = lease.jobId;
      headers["Fencing-Token"] = String(lease.generation);
      headers["Fencing-Owner"] = lease.owner;
      const [status, answerHeaders, answer] = await this.#send(method.toUpperCase(), url, body, headers);
      if (!answerHeaders.has("Sinkgate-Rejected")) {
        const replayed = (answerHeaders.get("Idempotent-Replayed") ?? "").toLowerCase() === "true";
        if (replayed && storedFenceRefusal(status, answer)) throw rejectionFromResponse(status, answerHeaders, answer);
        return result(status, answerHeaders, answer, replayed);
      }
      const rejection = rejectionFromResponse(status, answerHeaders, answer);
      if (!RETRIED_REASONS.has(rejection.reason)) throw rejection;
      const backoff = Math.min(rejection.retryAfter ?? 0.05 * 2 ** retries, this.#maxRetryWait);
      const applied = appliedWait(answerHeaders.get("Preference-Applied"));
      if (applied !== undefined) {
        // The gateway held the write (and is asked again at once, no second wait on top
        // of its own). A retry is counted when the holds add up to the sleep it stands
        // for, so that a destination's short `max_wait` leaves the writer as patient
        // as one that does not wait.
        held += applied;
        if (held < backoff) continue;
      }
      if (retries >= this.#maxRetries) throw rejection;
      retries += 1;
      held = 0;
      if (applied === undefined) await sleep(backoff, this.#signals);
    }
  }

  /** No effect under a lost lease: throw the hold's `LeaseLost` (or the signal's reason). */
  #check(): void {
    if ("check" in this.#lease) this.#lease.check();
    for (const signal of this.#signals) signal.throwIfAborted();
  }

  #headers(given: WriteOptions["headers"], contentType: string | undefined, key: string) {
    const headers: Record<string, string> = {};
    const prefer: string[] = [];
    for (const [name, value] of entries(given, "headers")) {
      if (typeof name !== "string" || !TOKEN.test(name)) {
        throw new RangeError(`header name ${JSON.stringify(name)} is not an HTTP token`);
      }
      if (typeof value !== "string") throw new TypeError(`header ${name} must be a string, not ${typeName(value)}`);
      if (UNSENDABLE.test(value)) {
        throw new RangeError(`header ${name}: a value is ASCII without control characters (tabs aside)`);
      }
      if (OWN_HEADERS.has(name.toLowerCase()))
        throw new TypeError(`the writer sets ${name} itself; pass it as an option`);
      if (CONNECTION_HEADERS.has(name.toLowerCase()))
        throw new TypeError(`${name} is the HTTP client's to set, not a header to pass`);
      if (name.toLowerCase() === "prefer") prefer.push(value);
      else headers[name] = value;
    }
    if (contentType !== undefined && !Object.keys(headers).some((name) => name.toLowerCase() === "content-type")) {
      headers["Content-Type"] = contentType;
    }
    headers["Idempotency-Key"] = key;
    const preferences = mergePrefer(prefer, this.#prefer);
    if (preferences !== undefined) headers.Prefer = preferences;
    if (this.#token !== undefined) headers.Authorization = `Bearer ${this.#token}`;
    return headers;
  }

  #url(method: string, destination: string, path: string, query: WriteOptions["query"]): string {
    if (typeof method !== "string" || !METHOD.test(method)) throw new TypeError(`invalid method ${String(method)}`);
    if (FORBIDDEN_METHODS.has(method.toUpperCase())) throw new TypeError(`fetch cannot send ${method} requests`);
    if (typeof destination !== "string" || destination === "" || destination.includes("/")) {
      throw new TypeError(`destination must be a name without '/', not ${JSON.stringify(destination)}`);
    }
    if (destination === "." || destination === "..") {
      throw new RangeError(`destination must not be '.' or '..', not ${JSON.stringify(destination)}`);
    }
    if (typeof path !== "string") throw new TypeError(`path must be a string, not ${typeName(path)}`);
    if (CONTROL.test(path)) {
      // The URL parser drops tabs and newlines, which would join "." and "." into "..".
      throw new RangeError(`path must not contain control characters: ${JSON.stringify(path)}`);
    }
    // The URL parser reads "\\" as "/" (then resolves dot segments); Python's writer sends %5C.
    const full = (path === "" || path.startsWith("/") ? path : `/${path}`).replaceAll("\\", "%5C");
    const segments = (full.split("?", 1)[0] ?? "").split("/");
    if (segments.some((segment) => [".", ".."].includes(segment.toLowerCase().replaceAll("%2e", ".")))) {
      // The URL would be normalised on the way (possibly out of /to/...).
      throw new RangeError(`path must not contain '.' or '..' segments: ${JSON.stringify(path)}`);
    }
    const route = `${this.#base}/to/${encodeURIComponent(destination)}`;
    const url = route + writeTarget(full, query);
    // What fetch will send, parsed as it parses it: still under this destination's route.
    const prefix = new URL(route).pathname;
    const sent = new URL(url).pathname;
    if (sent !== prefix && !sent.startsWith(`${prefix}/`)) {
      throw new RangeError(`path ${JSON.stringify(path)} leaves ${prefix}/`);
    }
    return url;
  }

  async #send(method: string, url: string, body: Uint8Array | undefined, headers: Record<string, string>) {
    const request = bounded(this.#signals, this.#timeout);
    try {
      const init: RequestInit = { method, headers, redirect: "manual", signal: request.signal };
      if (body !== undefined) init.body = body;
      const resp = await fetch(url, init);
      const answer = new Uint8Array(await resp.arrayBuffer());
      return [resp.status, resp.headers, answer] as const;
    } catch (error) {
      this.#check(); // cut by the hold: its LeaseLost, not a network error
      if (request.timedOut())
        throw new GatewayUnavailable(GATEWAY_TIMEOUT, { detail: "no answer from the gateway in time", cause: error });
      throw new GatewayUnavailable(GATEWAY_UNREACHABLE, {
        detail: `${unanswered(error)}: ${networkWords(error)}`,
        cause: error,
      });
    } finally {
      request.done();
    }
  }
}

// fetch's (undici's and the system's) codes for a connection never made: nothing
// was sent. Any other failure may have come after the write reached the gateway.
const NOT_CONNECTED = new Set([
  "ECONNREFUSED",
  "ENOTFOUND",
  "EAI_AGAIN",
  "EHOSTUNREACH",
  "ENETUNREACH",
  "EADDRNOTAVAIL",
  "UND_ERR_CONNECT_TIMEOUT",
]);

/** What a write that got no answer may have done: nothing, if no connection was
 * made; else the gateway may have it (a retry with the same key is decided by it).
 * As the Python writer's `_unanswered`. */
function unanswered(error: unknown): string {
  const cause = error instanceof Error ? error.cause : undefined;
  const code = typeof cause === "object" && cause !== null && "code" in cause ? String(cause.code) : "";
  return NOT_CONNECTED.has(code)
    ? "cannot reach the gateway"
    : "no usable answer from the gateway, which may have the write";
}

/** One `Prefer` value: the caller's preferences first, then the writer's
 * `wait=N`. Checked as the gateway will read what is sent (the values stripped
 * and joined): a `wait` of the caller's is a bad argument (the writer's `wait`
 * option says it, and the gateway reads only the first `wait` it finds); so is,
 * under a wait of the writer's, a value the gateway would not read to its end
 * (not a preference list, or the whole longer than it reads): the writer's
 * `wait` after it would never be seen. As the Python writer's `_prefer`. */
function mergePrefer(given: readonly string[], wait: string | undefined): string | undefined {
  for (const value of given) {
    if (typeof value !== "string") throw new TypeError(`Prefer must be a string, not ${typeName(value)}`);
  }
  const stripped = given.map(strip).filter((value) => value !== "");
  const callers = stripped.join(", ");
  const shown = JSON.stringify(callers.slice(0, 80));
  // Any length: a `wait` in a value too long for the gateway to read is refused all
  // the same, and the length is said by the check on the merged value.
  const read = readPreferences(callers, Number.POSITIVE_INFINITY);
  if (read.names.includes("wait")) {
    throw new RangeError(`Prefer ${shown}: the writer sets the wait preference itself; pass the wait option`);
  }
  if (wait === undefined) return callers === "" ? undefined : callers;
  if (!read.whole) {
    throw new RangeError(
      `Prefer ${shown} is not a list of preferences (RFC 7240): ` +
        "the gateway would stop reading it there and never see the writer's wait",
    );
  }
  const merged = [...stripped, wait].join(", ");
  const length = [...merged].length;
  if (length > MAX_VALUE) {
    throw new RangeError(
      `Prefer: with the writer's ${wait} it is ${length} characters, and the gateway reads at most ${MAX_VALUE}`,
    );
  }
  return merged;
}

function result(status: number, headers: Headers, body: Uint8Array, replayed: boolean): WriteResult {
  return {
    status,
    headers,
    body,
    replayed,
    json: () => JSON.parse(new TextDecoder().decode(body)) as unknown,
    text: () => new TextDecoder().decode(body),
  };
}

const encoder = new TextEncoder();

function encodeBody(options: WriteOptions): [Uint8Array | undefined, string | undefined] {
  if (options.json !== undefined && options.body !== undefined) throw new TypeError("pass json or body, not both");
  if (options.json !== undefined) {
    // Sorted and compact, as the Python writer: two workers sending the same
    // payload send the same bytes, so the second gets the first one's replay.
    return [encoder.encode(canonicalJson(options.json)), "application/json"];
  }
  if (typeof options.body === "string") return [encoder.encode(options.body), "text/plain; charset=utf-8"];
  if (options.body === undefined) return [undefined, undefined];
  // As the Python writer (aiohttp's default for bytes): the content type is in the fingerprint.
  if (options.body instanceof Uint8Array) return [options.body, "application/octet-stream"];
  throw new TypeError(`body must be a Uint8Array or a string, not ${typeName(options.body)}`);
}

/** A replay of the destination's own fence refusal (SPEC 3.1) carries no
 * `Sinkgate-Rejected`, only the stored 409 and its problem body: the same
 * refusal as the first answer, so it throws the same way. */
function storedFenceRefusal(status: number, body: Uint8Array): boolean {
  return status === 409 && parseObject(body)?.reason === "stale_generation";
}
