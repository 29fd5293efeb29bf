/**
 * `hold`: keep a lease renewed while a body of work runs, and stop the work the
 * moment the lease may be gone - the rules of the Python `leases.hold`.
 *
 * The watchdog renews every `ttl * renewFraction`. Two things end the hold
 * early: a renewal the store refuses, or the worker's own monotonic deadline
 * (`ttl * (1 - safetyMargin)` after the last successful renewal, or the claim,
 * was *sent*) passing without a successful renewal. Either way the body's
 * `signal` is aborted with a `LeaseLost` (so a `FencedWriter` bound to it cuts
 * its request in flight and refuses to send another) and `hold` rejects with it
 * at once - before the store could hand the job to anybody else, since the
 * store's lease always ends after the local deadline. A claim whose answer
 * arrives after that deadline never starts the body.
 */

import { bounded, sleep, timerDelay } from "./abort.js";
import type { CallOptions, Lease, LeaseClient } from "./client.js";
import { LeaseLost, StoreUnavailable } from "./errors.js";
import { typeName, validateIdent, validateOptions, validateSeconds, validateSignal, validateTtl } from "./validate.js";

export type OnExit = "complete" | "release" | "keep";

export interface HoldOptions {
  /** Owner id (default: host, pid and a random part). */
  readonly owner?: string | undefined;
  /** Lease length in seconds (default 30). */
  readonly ttl?: number;
  /** What a normal return does: mark the job done (default), free it, or leave it to expire. */
  readonly onExit?: OnExit;
  /** Renew every `ttl * renewFraction` (default 1/3). */
  readonly renewFraction?: number;
  /** Give the lease up locally `ttl * safetyMargin` early (default 0.05), for a slow worker clock. */
  readonly safetyMargin?: number;
  /** Seconds giving the lease back after an outside abort may take, a claim still on the wire included (default 2). */
  readonly cancelTimeout?: number;
  /** Aborting it (the worker shutting down) stops the body and releases the lease. */
  readonly signal?: AbortSignal | undefined;
  /** The worker's monotonic clock in seconds (default `performance.now() / 1000`). */
  readonly monotonic?: () => number;
}

/** The lease a `hold` body gets: the latest renewal, and the hold's live state. */
export interface HeldLease extends Lease {
  /** Aborted (with the `LeaseLost`) once the lease may be gone. */
  readonly signal: AbortSignal;
  /** Throw the `LeaseLost` if the lease is lost or the local deadline has passed. */
  check(): void;
}

/** PURE: when to renew, and until when the lease is safe, on the worker's own clock. */
export class RenewalSchedule {
  constructor(
    readonly ttl: number,
    readonly renewFraction = 1 / 3,
    readonly safetyMargin = 0.05,
  ) {
    validateTtl(ttl);
    for (const [name, value] of [
      ["renewFraction", renewFraction],
      ["safetyMargin", safetyMargin],
    ] as const) {
      if (typeof value !== "number") throw new TypeError(`${name} must be a number, not ${typeName(value)}`);
    }
    if (!(renewFraction > 0 && renewFraction < 1)) throw new RangeError("renewFraction must be between 0 and 1");
    if (!(safetyMargin >= 0 && safetyMargin < renewFraction)) {
      throw new RangeError("safetyMargin must be between 0 and renewFraction");
    }
    // The first renewal would fall due after the local deadline: every hold lost.
    if (!(renewFraction + safetyMargin < 1)) throw new RangeError("renewFraction + safetyMargin must be below 1");
  }

  /** The local deadline of a lease claimed or renewed by a request sent at `sent`. */
  deadline(sent: number): number {
    return sent + this.ttl * (1 - this.safetyMargin);
  }

  /** How long to sleep before the next renewal (never past the deadline). */
  wait(now: number, deadline: number): number {
    return Math.max(0, Math.min(now + this.ttl * this.renewFraction, deadline) - now);
  }
}

const performanceClock = (): number => performance.now() / 1000;

/** The live state of one held lease. */
class Hold {
  lost: LeaseLost | undefined;
  readonly body = new AbortController();

  constructor(
    public lease: Lease,
    public deadline: number,
    readonly now: () => number,
  ) {}

  check(): void {
    if (this.lost === undefined && this.now() >= this.deadline) this.lose("lease_expired");
    if (this.lost !== undefined) throw this.lost;
  }

  /** Lost for `reason`, or as the gateway's `LeaseLost` answer says (kept whole,
   * its status, detail and problem with it); `cause`: the last renewal's error
   * (a 401 of a wrong lease token, say), where that is why. */
  lose(reason: string | LeaseLost, cause?: unknown): void {
    this.lost ??=
      reason instanceof LeaseLost
        ? reason
        : new LeaseLost(
            this.lease.jobId,
            this.lease.generation,
            reason,
            undefined,
            cause === undefined ? {} : { cause },
          );
    this.body.abort(this.lost);
  }

  held(): HeldLease {
    const state = this;
    return Object.freeze({
      get jobId() {
        return state.lease.jobId;
      },
      get owner() {
        return state.lease.owner;
      },
      get generation() {
        return state.lease.generation;
      },
      get state() {
        return state.lease.state;
      },
      get leaseUntil() {
        return state.lease.leaseUntil;
      },
      get expiresIn() {
        return state.lease.expiresIn;
      },
      signal: state.body.signal,
      check: () => state.check(),
    });
  }
}

/**
 * Claim `jobId`, run `body(lease, signal)` while the lease is renewed in the
 * background, then complete the job (`onExit`) and resolve with the body's value.
 *
 * Rejects with `LeaseHeld`/`JobCompleted` from the claim; with `LeaseLost` as
 * soon as the lease may be gone (`signal` is aborted with it first); with the
 * body's own error after releasing the job; with the outside `signal`'s reason
 * after releasing the job when the worker is shutting down.
 */
export async function hold<T>(
  client: LeaseClient,
  jobId: string,
  options: HoldOptions,
  body: (lease: HeldLease, signal: AbortSignal) => Promise<T> | T,
): Promise<T> {
  validateClient(client);
  validateIdent(jobId, "jobId");
  validateOptions(options, "options");
  validateSignal(options.signal, "signal");
  if (typeof body !== "function") throw new TypeError("body must be a function");
  const schedule = new RenewalSchedule(
    validateTtl(options.ttl ?? 30),
    options.renewFraction ?? 1 / 3,
    options.safetyMargin ?? 0.05,
  );
  const onExit = options.onExit ?? "complete";
  if (!["complete", "release", "keep"].includes(onExit))
    throw new RangeError("onExit must be complete, release or keep");
  const cancelTimeout = validateSeconds(options.cancelTimeout ?? 2, "cancelTimeout", true);
  const now = options.monotonic ?? performanceClock;
  const outside = options.signal;
  outside?.throwIfAborted();

  const started = now();
  const lease = await claim(client, jobId, options.owner, schedule.ttl, outside, cancelTimeout);
  const state = new Hold(lease, schedule.deadline(started), now);
  if (outside?.aborted) {
    await giveBack(client, state, cancelTimeout);
    throw outside.reason;
  }
  if (now() >= state.deadline) {
    // By the worker's clock the lease may already have run out: never start.
    await giveBack(client, state, cancelTimeout);
    throw new LeaseLost(lease.jobId, lease.generation, "lease_expired");
  }
  const watching = new AbortController();
  const watchdog = watch(client, state, schedule, watching.signal);
  const stopWatching = async (): Promise<void> => {
    watching.abort();
    await watchdog;
  };
  const onOutside = (): void => state.body.abort(outside?.reason);
  outside?.addEventListener("abort", onOutside, { once: true });
  try {
    return await settle(client, state, body, onExit, cancelTimeout, stopWatching, outside);
  } finally {
    outside?.removeEventListener("abort", onOutside); // a worker-wide signal outlives many holds
  }
}

/** Run the body until it settles or the lease is lost (or the worker shuts down), then exit. */
async function settle<T>(
  client: LeaseClient,
  state: Hold,
  body: (lease: HeldLease, signal: AbortSignal) => Promise<T> | T,
  onExit: OnExit,
  cancelTimeout: number,
  stopWatching: () => Promise<void>,
  outside: AbortSignal | undefined,
): Promise<T> {
  const ended = new Promise<"ended">((resolve) => {
    state.body.signal.addEventListener("abort", () => resolve("ended"), { once: true });
  });
  const run = Promise.resolve().then(() => body(state.held(), state.body.signal));
  const outcome = await Promise.race([
    run.then(
      (value) => ({ ok: true as const, value }),
      (error: unknown) => ({ ok: false as const, error }),
    ),
    ended,
  ]);
  if (outcome === "ended") {
    run.catch(() => undefined); // its late outcome is nobody's: the hold has ended
    await stopWatching();
    if (state.lost !== undefined) throw state.lost;
    await giveBack(client, state, cancelTimeout);
    throw outside?.reason;
  }
  await stopWatching();
  if (!outcome.ok) {
    if (!(outcome.error instanceof LeaseLost) && state.lost === undefined) {
      // The body's error is what the caller needs; a release refused otherwise (a 400,
      // say) must not replace it. The lease then expires by itself.
      await exitCall(outside, cancelTimeout, (signal) => release(client, state, { signal })).catch((error: unknown) => {
        if (outside?.aborted) throw error; // shutting down: that is the outcome
      });
    }
    throw outcome.error;
  }
  if (state.lost !== undefined) throw state.lost;
  if (onExit === "complete") {
    state.lease = await exitCall(outside, cancelTimeout, (signal) => client.complete(state.lease, { signal }));
  } else if (onExit === "release") {
    await exitCall(outside, cancelTimeout, (signal) => release(client, state, { signal }));
  }
  return outcome.value;
}

/** An exit's store call (`work`), as long as it takes and its outcome the
 * caller's, until the outside `signal` aborts (the worker shutting down); from
 * then on it gets `cancelTimeout` more seconds and is cut, and the abort's
 * reason is the outcome, as in the Python `hold`. The lease of an exit cut so
 * expires by itself. */
async function exitCall<T>(
  outside: AbortSignal | undefined,
  cancelTimeout: number,
  work: (signal: AbortSignal | undefined) => Promise<T>,
): Promise<T> {
  if (outside === undefined) return work(undefined);
  const cut = new AbortController();
  const call = work(cut.signal);
  let onAbort = (): void => undefined;
  const aborted = new Promise<"aborted">((resolve) => {
    onAbort = () => resolve("aborted");
    if (outside.aborted) resolve("aborted");
    else outside.addEventListener("abort", onAbort, { once: true });
  });
  try {
    const first = await Promise.race([call.then((value) => ({ value })), aborted]);
    if (first !== "aborted") return first.value;
  } finally {
    outside.removeEventListener("abort", onAbort);
  }
  const timer = setTimeout(() => cut.abort(new StoreUnavailable("exit timed out")), timerDelay(cancelTimeout));
  try {
    await call;
  } catch {
    // refused, unreachable or cut: the shutdown is the outcome
  } finally {
    clearTimeout(timer);
  }
  throw outside.reason;
}

/** The claim; the outside `signal` aborting while it is on the wire ends the wait
 * at once. The gateway may grant the claim all the same: its answer is awaited
 * and the lease given back, as the Python `hold` does, so the job is not
 * blocked for a ttl. Both calls together are cut at `cancelTimeout` seconds, so
 * a worker shutting down is not kept up by them. */
async function claim(
  client: LeaseClient,
  jobId: string,
  owner: string | undefined,
  ttl: number,
  outside: AbortSignal | undefined,
  cancelTimeout: number,
): Promise<Lease> {
  if (outside === undefined) return client.claim(jobId, { owner, ttl });
  const giveUp = new AbortController();
  const claiming = client.claim(jobId, { owner, ttl, signal: giveUp.signal });
  let onAbort = (): void => undefined;
  const aborted = new Promise<"aborted">((resolve) => {
    onAbort = () => resolve("aborted");
    outside.addEventListener("abort", onAbort, { once: true });
  });
  try {
    const first = await Promise.race([claiming, aborted]);
    if (first !== "aborted") return first;
  } finally {
    outside.removeEventListener("abort", onAbort);
  }
  claiming.catch(() => undefined); // refused, unanswered or cut: nothing to give back
  await within(cancelTimeout, giveUp, async (signal) => client.release(await claiming, { signal }));
  throw outside.reason;
}

/** A `LeaseClient`, or anything with its four lease calls (a test's double). */
function validateClient(client: unknown): void {
  const calls = ["claim", "renew", "complete", "release"] as const;
  const object = client as Record<string, unknown> | null;
  if (object === null || typeof object !== "object" || calls.some((c) => typeof object[c] !== "function")) {
    throw new TypeError(`client must be a LeaseClient, not ${typeName(client)}`);
  }
}

/** The watchdog: renew on schedule; on a refusal or a passed deadline, lose the lease. */
async function watch(client: LeaseClient, state: Hold, schedule: RenewalSchedule, stop: AbortSignal): Promise<void> {
  // The deadline passing after a failed renewal is the store's fault, not the
  // worker's: the loss then says `store_unavailable`, the last failure its cause.
  let failure: unknown;
  let unreachable = false;
  try {
    for (;;) {
      const slept = state.now();
      const pause = schedule.wait(slept, state.deadline);
      await sleep(pause, stop);
      // A sleep to the deadline ends it, even when the timer fires a hair early
      // (Node's timers keep whole milliseconds): a renewal sent then has no time
      // to be answered, and its cut would stand in for the last failure's cause.
      if (slept + pause >= state.deadline || state.now() >= state.deadline) {
        if (unreachable) state.lose("store_unavailable", failure);
        else state.lose("lease_expired");
        return;
      }
      const sent = state.now();
      // Cut at the local deadline: a renewal still unanswered then can no longer help.
      const call = bounded(stop, Math.max(0, state.deadline - sent));
      try {
        state.lease = await client.renew(state.lease, { ttl: schedule.ttl, signal: call.signal });
      } catch (error) {
        if (stop.aborted) return;
        if (error instanceof LeaseLost) {
          state.lose(error);
          return;
        }
        // StoreUnavailable, our own timeout, or an answer we could not read:
        // transient, try again until the local deadline. A renewal cut there
        // unanswered is the lease API's failure too, and said as one.
        failure = call.timedOut()
          ? new StoreUnavailable("the lease API did not answer a renewal before the local deadline", {
              cause: error,
            })
          : error;
        if (state.now() >= state.deadline) {
          state.lose("store_unavailable", failure);
          return;
        }
        unreachable = true;
        continue;
      } finally {
        call.done();
      }
      unreachable = false;
      state.deadline = schedule.deadline(sent);
    }
  } catch {
    // only the sleep throws here, when the hold ends; anything else loses the lease
    if (!stop.aborted) state.lose("store_unavailable");
  }
}

/** Free the job after the body failed; a refusal or an unreachable store changes
 * nothing (the lease then expires by itself). */
async function release(client: LeaseClient, state: Hold, options: CallOptions = {}): Promise<void> {
  try {
    state.lease = await client.release(state.lease, options);
  } catch (error) {
    if (!(error instanceof LeaseLost || error instanceof StoreUnavailable)) throw error;
  }
}

/** Give the lease back within `seconds` (shutting down, or claimed too late). */
async function giveBack(client: LeaseClient, state: Hold, seconds: number): Promise<void> {
  await within(seconds, new AbortController(), (signal) => release(client, state, { signal }));
}

/** Run `work`, aborting its signal (`controller`'s) after `seconds`; a failure
 * or the cut changes nothing: an unreleased lease expires by itself. */
async function within(
  seconds: number,
  controller: AbortController,
  work: (signal: AbortSignal) => Promise<unknown>,
): Promise<void> {
  const timer = setTimeout(() => controller.abort(new StoreUnavailable("release timed out")), timerDelay(seconds));
  try {
    await work(controller.signal);
  } catch {
    // refused, unreachable or cut: the lease expires by itself
  } finally {
    clearTimeout(timer);
  }
}
