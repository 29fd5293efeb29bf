/** One request's abort signal: the caller's signal (if any) and a timeout, with
 * which of the two fired. `AbortSignal.any` is not in Node 18, hence this. */

export interface Bounded {
  readonly signal: AbortSignal;
  /** The timeout fired (not the caller's signal). */
  timedOut(): boolean;
  /** Remove the timer and the listener: call once the request is over. */
  done(): void;
}

export function bounded(outer: AbortSignal | undefined, seconds: number): Bounded {
  const controller = new AbortController();
  let expired = false;
  const onAbort = (): void => controller.abort(outer?.reason);
  const timer = setTimeout(() => {
    expired = true;
    controller.abort(new Error(`timed out after ${seconds}s`));
  }, seconds * 1000);
  if (outer?.aborted) onAbort();
  else outer?.addEventListener("abort", onAbort, { once: true });
  return {
    signal: controller.signal,
    timedOut: () => expired && !outer?.aborted,
    done: () => {
      clearTimeout(timer);
      outer?.removeEventListener("abort", onAbort);
    },
  };
}

/** Sleep `seconds`; reject with the signal's reason as soon as it aborts. */
export function sleep(seconds: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(signal.reason);
      return;
    }
    const onAbort = (): void => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(
      () => {
        signal?.removeEventListener("abort", onAbort);
        resolve();
      },
      Math.max(0, seconds * 1000),
    );
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}
