/** Argument checks shared by the client, `hold` and the writer: bad arguments
 * throw `TypeError` (wrong type) or `RangeError` (wrong value) and send nothing. */

export const TTL_MIN = 0.05;
export const TTL_MAX = 86400;
const IDENT = /^[\x21-\x7e]{1,256}$/;
const VISIBLE = /^[\x21-\x7e]+$/;

/** A job or owner id: 1-256 visible ASCII characters (0x21-0x7E). */
export function validateIdent(value: unknown, what: string): string {
  if (typeof value !== "string") throw new TypeError(`${what} must be a string, not ${typeName(value)}`);
  if (!IDENT.test(value)) throw new RangeError(`${what} must be 1-256 visible ASCII characters (0x21-0x7E)`);
  return value;
}

/** A ttl in seconds, from 0.05 to 86400. */
export function validateTtl(value: unknown): number {
  if (typeof value !== "number") throw new TypeError(`ttl must be a number of seconds, not ${typeName(value)}`);
  if (!(Number.isFinite(value) && value >= TTL_MIN && value <= TTL_MAX)) {
    throw new RangeError(`ttl must be between ${TTL_MIN} and ${TTL_MAX} seconds`);
  }
  return value;
}

/** A generation: an integer from 1 that a JS number holds exactly. */
export function validateGeneration(value: unknown): number {
  if (typeof value !== "number" || !Number.isInteger(value)) {
    throw new TypeError(`generation must be an integer, not ${typeName(value)}`);
  }
  if (!(value >= 1 && Number.isSafeInteger(value))) {
    throw new RangeError("generation must be between 1 and 2**53-1");
  }
  return value;
}

/** Seconds >= 0 (`positive`: > 0). */
export function validateSeconds(value: unknown, what: string, positive = false): number {
  if (typeof value !== "number") throw new TypeError(`${what} must be a number of seconds, not ${typeName(value)}`);
  if (!(Number.isFinite(value) && (positive ? value > 0 : value >= 0))) {
    throw new RangeError(`${what} must be a ${positive ? "positive" : "non-negative"} number of seconds`);
  }
  return value;
}

export function validateVisible(value: unknown, what: string): string {
  if (typeof value !== "string") throw new TypeError(`${what} must be a string, not ${typeName(value)}`);
  if (!VISIBLE.test(value)) throw new RangeError(`${what} must be visible ASCII (0x21-0x7E)`);
  return value;
}

/** An options argument: an object (arrays and functions aside). */
export function validateOptions<T>(value: T, what: string): T {
  if (value === null || typeof value !== "object" || Array.isArray(value)) {
    throw new TypeError(`${what} must be an object, not ${typeName(value)}`);
  }
  return value;
}

/** An optional `signal` option: an `AbortSignal` or undefined. */
export function validateSignal(value: unknown, what: string): AbortSignal | undefined {
  if (value !== undefined && !(value instanceof AbortSignal)) {
    throw new TypeError(`${what} must be an AbortSignal, not ${typeName(value)}`);
  }
  return value;
}

/** An http(s) base URL without query or fragment, trailing `/` dropped. */
export function baseUrl(value: unknown, what: string): string {
  if (typeof value !== "string") throw new TypeError(`${what} must be a string, not ${typeName(value)}`);
  let url: URL;
  try {
    url = new URL(value);
  } catch {
    throw new RangeError(`${what} must be http(s)://host[:port], not ${JSON.stringify(value)}`);
  }
  if ((url.protocol !== "http:" && url.protocol !== "https:") || !url.hostname) {
    throw new RangeError(`${what} must be http(s)://host[:port], not ${JSON.stringify(value)}`);
  }
  if (url.search || url.hash) throw new RangeError(`${what} must not carry a query or fragment`);
  // fetch refuses a URL with credentials: every call would fail as an outage
  if (url.username || url.password) throw new RangeError(`${what} must not carry user:password@; pass a token`);
  return url.href.replace(/\/+$/, "");
}

export function typeName(value: unknown): string {
  return value === null ? "null" : Array.isArray(value) ? "array" : typeof value;
}
