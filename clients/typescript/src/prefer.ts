/**
 * The preferences of a `Prefer` header value (RFC 7240), read as the Python
 * `leases.prefer` reads them: comma-separated elements, each a name with an
 * optional `= value` (a token or a quoted string, inside which a comma
 * separates nothing) and `;` parameters; empty elements are skipped. A value
 * that stops being a preference list is read up to there; one longer than
 * `MAX_VALUE` characters is not read at all.
 */

export const MAX_VALUE = 1024;

/** What was read of a value: the preferences' names, lower-cased, in order, and
 * whether the whole value was read (a preference list, at most `MAX_VALUE`). */
export interface Preferences {
  readonly names: string[];
  readonly whole: boolean;
}

const NAME = /[!#$%&'*+\-.^_`|~0-9A-Za-z]+/y;
// Python's `\s` (what `str.isspace` calls space), not JavaScript's: U+001C-U+001F
// and U+0085 are space to Python, U+FEFF is not.
const PY_SPACE = "\\t\\n\\v\\f\\r \\x1c-\\x1f\\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000";
const SPACE = new RegExp(`[${PY_SPACE}]*`, "y");
const ENDS = new RegExp(`^[${PY_SPACE}]+|[${PY_SPACE}]+$`, "g");
const EMPTY = /[ \t,]*/y;

/** `value` without the space at its ends, as Python's `str.strip()` takes it. */
export function strip(value: string): string {
  return value.replace(ENDS, "");
}

/** `value` read as `leases.prefer` reads it; one longer than `longest` characters
 * is not read (`Infinity`: any length is). */
export function readPreferences(value: string, longest = MAX_VALUE): Preferences {
  const names: string[] = [];
  if (value.length > longest && [...value].length > longest) {
    return { names, whole: false };
  }
  let at = skip(EMPTY, value, 0);
  while (at < value.length) {
    const start = skip(SPACE, value, at);
    NAME.lastIndex = start;
    const name = NAME.exec(value);
    if (name === null) return { names, whole: false }; // not a preference list from here on
    at = skip(SPACE, value, start + name[0].length);
    // The rest of the element: its value and parameters, a quoted string whole.
    while (at < value.length && value[at] !== ",") {
      if (value[at] === '"') {
        const end = closingQuote(value, at + 1);
        if (end < 0) return { names, whole: false }; // an unterminated quote: no element
        at = end + 1;
      } else {
        at += 1;
      }
    }
    names.push(name[0].toLowerCase());
    at = skip(EMPTY, value, at);
  }
  return { names, whole: true };
}

function skip(pattern: RegExp, value: string, at: number): number {
  pattern.lastIndex = at;
  pattern.exec(value);
  return pattern.lastIndex;
}

/** Where the quoted string opened before `at` closes, or -1. A backslash escapes
 * the next character, but not a line feed nor the end (Python's `\\.`). */
function closingQuote(value: string, at: number): number {
  for (let i = at; i < value.length; i++) {
    if (value[i] === "\\") {
      if (i + 1 >= value.length || value[i + 1] === "\n") return -1;
      i += 1;
    } else if (value[i] === '"') {
      return i;
    }
  }
  return -1;
}

// The gateway's `Preference-Applied: wait=M`, among any preferences of the upstream's.
const APPLIED = /(?:^|,)[ \t]*wait[ \t]*=[ \t]*"?([0-9]{1,12})"?[ \t]*(?:[;,]|$)/i;

/** The seconds a `Preference-Applied` value says the gateway held the write:
 * `undefined` without the header, `Infinity` (a whole retry's worth) when its
 * `wait=M` cannot be read or is 0 (which, summed, would never count a retry). */
export function appliedWait(value: string | null): number | undefined {
  if (value === null) return undefined;
  const found = APPLIED.exec(value);
  const seconds = found === null ? 0 : Number(found[1]);
  return seconds > 0 ? seconds : Number.POSITIVE_INFINITY;
}
