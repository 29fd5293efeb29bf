/**
 * The preferences of a `Prefer` header value (RFC 7240), read as the Python
 * `leases.prefer` reads them: comma-separated elements, each a name with an
 * optional `= value` (a token or a quoted string, inside which a comma
 * separates nothing) and `;` parameters; empty elements are skipped. A value
 * that stops being a preference list is read up to there; one longer than
 * `MAX_VALUE` is not read at all.
 */

export const MAX_VALUE = 1024;

const NAME = /[!#$%&'*+\-.^_`|~0-9A-Za-z]+/y;
const SPACE = /\s*/y;
const EMPTY = /[ \t,]*/y;

/** The names of the preferences in `value`, lower-cased, in order. */
export function preferenceNames(value: string): string[] {
  const names: string[] = [];
  if (value.length > MAX_VALUE) return names;
  let at = skip(EMPTY, value, 0);
  while (at < value.length) {
    const start = skip(SPACE, value, at);
    NAME.lastIndex = start;
    const name = NAME.exec(value);
    if (name === null) break; // not a preference list from here on
    at = skip(SPACE, value, start + name[0].length);
    // The rest of the element: its value and parameters, a quoted string whole.
    let complete = true;
    while (at < value.length && value[at] !== ",") {
      if (value[at] === '"') {
        const end = closingQuote(value, at + 1);
        if (end < 0) {
          complete = false; // an unterminated quote: the element is not one
          break;
        }
        at = end + 1;
      } else {
        at += 1;
      }
    }
    if (!complete) break;
    names.push(name[0].toLowerCase());
    at = skip(EMPTY, value, at);
  }
  return names;
}

function skip(pattern: RegExp, value: string, at: number): number {
  pattern.lastIndex = at;
  pattern.exec(value);
  return pattern.lastIndex;
}

/** Where the quoted string opened before `at` closes (a backslash escapes the next character), or -1. */
function closingQuote(value: string, at: number): number {
  for (let i = at; i < value.length; i++) {
    if (value[i] === "\\") i += 1;
    else if (value[i] === '"') return i;
  }
  return -1;
}
