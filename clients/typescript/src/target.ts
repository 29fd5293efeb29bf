/**
 * The path and query a fenced write sends after `/to/{destination}`, spelled by
 * the writer itself rather than by `URL`, byte for byte as the Python writer
 * spells them (`leases/target.py`).
 *
 * The gateway fingerprints the path and query as sent, so a job redone by a
 * worker in the other language must send the same bytes to be replayed. What
 * RFC 3986 allows in a path (and `?` in the query) is kept, and so is a `%XX`
 * escape, as written; every other character is percent-encoded as UTF-8: a `%`
 * that starts no escape, `#`, space, `|`, `[`, non-ASCII, and in the query `'`
 * (which `fetch` would encode on its own). An empty query is left out, `?` and
 * all. A `query` name or value keeps only the unreserved characters, and the
 * pairs go in the order of their spelled names (an object puts integer-like
 * names first, a Python dict does not). The shared table of spellings is
 * `tests/vectors/write_spellings.json` at the repository's top.
 */

import { typeName } from "./validate.js";

/** Names and values for the query: an object, a `Map`, `URLSearchParams` or pairs. */
export type Query =
  | Readonly<Record<string, string | number>>
  | ReadonlyMap<string, string | number>
  | URLSearchParams
  | ReadonlyArray<readonly [string, string | number]>;

const PATH = /%[0-9A-Fa-f]{2}|[^A-Za-z0-9\-._~!$&'()*+,;=:@/]/gu;
const QUERY = /%[0-9A-Fa-f]{2}|[^A-Za-z0-9\-._~!$&()*+,;=:@/?]/gu;
const PARAM = /[^A-Za-z0-9\-._~]/gu;
const encoder = new TextEncoder();

/** `path` (already checked by the writer) and `query`, as sent; throws
 * `RangeError` for a lone surrogate, `TypeError` for a query of another shape. */
export function writeTarget(path: string, query?: Query): string {
  const at = path.indexOf("?");
  const rest = at >= 0 ? path.slice(at + 1) : "";
  const pairs = entries(query, "query").map(
    ([name, value]) => [spelled(PARAM, param(name)), spelled(PARAM, param(value))] as const,
  );
  pairs.sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  const parts = rest ? [spelled(QUERY, rest)] : [];
  for (const [name, value] of pairs) parts.push(`${name}=${value}`);
  return spelled(PATH, at >= 0 ? path.slice(0, at) : path) + (parts.length > 0 ? `?${parts.join("&")}` : "");
}

/** The (name, value) pairs of an object, a `Map`, `Headers`, `URLSearchParams` or
 * an array of pairs (`Object.entries` of a `Map` would be empty: nothing sent). */
export function entries(value: unknown, what: string): Array<[unknown, unknown]> {
  if (value === undefined) return [];
  if (value instanceof Map || value instanceof URLSearchParams || value instanceof Headers) {
    return [...value.entries()];
  }
  if (Array.isArray(value)) {
    if (!value.every((pair) => Array.isArray(pair) && pair.length === 2)) {
      throw new TypeError(`${what} pairs must each be [name, value]`);
    }
    return value.map((pair) => [pair[0], pair[1]]);
  }
  const proto = value === null || typeof value !== "object" ? undefined : Object.getPrototypeOf(value);
  if (proto !== Object.prototype && proto !== null) {
    throw new TypeError(`${what} must be an object of names and values, not ${typeName(value)}`);
  }
  return Object.entries(value as object);
}

function spelled(pattern: RegExp, text: string): string {
  return text.replace(pattern, (found) => {
    if (found.length === 3 && found.startsWith("%")) return found; // an escape, kept as written
    const code = found.charCodeAt(0);
    if (found.length === 1 && code >= 0xd800 && code <= 0xdfff) {
      throw new RangeError(`${JSON.stringify(text)} holds a lone surrogate, which UTF-8 cannot carry`);
    }
    return Array.from(encoder.encode(found), (byte) => `%${byte.toString(16).toUpperCase().padStart(2, "0")}`).join("");
  });
}

function param(value: unknown): string {
  if (typeof value === "string") return value;
  if (typeof value === "number" && Number.isSafeInteger(value)) return String(value);
  throw new TypeError(`query names and values must be strings, not ${typeName(value)}`);
}
