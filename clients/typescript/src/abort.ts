/** Abort signals: one request's signal (the caller's signals and a timeout, with
 * which of them fired), and a sleep that an abort ends. `AbortSignal.any` is not
 * in Node 18, hence these. */

/** The longest delay a Node timer keeps (2^31 - 1 ms, about 24.8 days): a longer
 * one overflows and fires after 1 ms. */
const LONGEST_TIMER_MS = 2 ** 31 - 1;

/** `seconds` as a timer's delay, at most the longest a timer keeps. */
/** What a failed `fetch` says, with why: undici's `TypeError: fetch failed` keeps
 * the reason (`connect ECONNREFUSED 127.0.0.1:1`, `getaddrinfo ENOTFOUND ...`) in
 * its `cause` only. */
export function networkWords(error: unknown): string {
  const words = String(error);
  const cause = error instanceof Error ? error.cause : undefined;
  if (cause === undefined || cause === null) return words;
  const code = typeof cause === "object" && "code" in cause ? String(cause.code) : "";
  const message = cause instanceof Error ? cause.message : String(cause);
  const why = message.includes(code) || code === "" ? message : `${code}: ${message}`;
  return why ? `${words} (${why})` : words;
}

export function timerDelay(seconds: number): number {
  return Math.min(Math.max(0, seconds * 1000), LONGEST_TIMER_MS);
}

export interface Bounded {
  readonly signal: AbortSignal;
  /** The timeout fired (not one of the caller's signals). */
  timedOut(): boolean;
  /** Remove the timer and the listeners: call once the request is over. */
  done(): void;
}

/** Aborted when any of `outer` aborts (with its reason), or after `seconds`. */
export function bounded(outer: AbortSignal | readonly AbortSignal[] | undefined, seconds: number): Bounded {
  const outers = outer === undefined ? [] : outer instanceof AbortSignal ? [outer] : outer;
  const controller = new AbortController();
  let expired = false;
  const listeners = outers.map((signal) => [signal, () => controller.abort(signal.reason)] as const);
  const timer = setTimeout(() => {
    expired = true;
    controller.abort(new Error(`timed out after ${Number(seconds.toFixed(3))}s`));
  }, timerDelay(seconds));
  const aborted = outers.find((signal) => signal.aborted);
  if (aborted !== undefined) controller.abort(aborted.reason);
  else for (const [signal, onAbort] of listeners) signal.addEventListener("abort", onAbort, { once: true });
  return {
    signal: controller.signal,
    timedOut: () => expired && !outers.some((signal) => signal.aborted),
    done: () => {
      clearTimeout(timer);
      for (const [signal, onAbort] of listeners) signal.removeEventListener("abort", onAbort);
    },
  };
}

/** Sleep `seconds`; reject with a signal's reason as soon as one of them aborts. */
export function sleep(seconds: number, signal?: AbortSignal | readonly AbortSignal[]): Promise<void> {
  const signals = signal === undefined ? [] : signal instanceof AbortSignal ? [signal] : signal;
  return new Promise((resolve, reject) => {
    const aborted = signals.find((one) => one.aborted);
    if (aborted !== undefined) {
      reject(aborted.reason);
      return;
    }
    const stop = (): void => {
      clearTimeout(timer);
      for (const one of signals) one.removeEventListener("abort", onAbort);
    };
    const onAbort = (event: Event): void => {
      stop();
      reject((event.target as AbortSignal).reason);
    };
    const timer = setTimeout(() => {
      stop();
      resolve();
    }, timerDelay(seconds));
    for (const one of signals) one.addEventListener("abort", onAbort, { once: true });
  });
}
