/**
 * JSON written byte for byte as Python's `json.dumps` writes it, so a key
 * derived here and a body sent from here are the ones a Python worker derives
 * and sends for the same job (SPEC 3.2): `ensure_ascii` escapes, Python's
 * float repr, and (for bodies) keys sorted by code point.
 */

const SHORT_ESCAPES: Readonly<Record<string, string>> = {
  '"': '\\"',
  "\\": "\\\\",
  "\b": "\\b",
  "\f": "\\f",
  "\n": "\\n",
  "\r": "\\r",
  "\t": "\\t",
};

const NEEDS_ESCAPE = /[^\x20\x21\x23-\x5b\x5d-\x7e]/;
const SURROGATE = /[\ud800-\udfff]/;

/** A string as `json.dumps` (ensure_ascii) quotes it: everything outside
 * 0x20-0x7E escaped, non-BMP characters as their two UTF-16 surrogates. */
export function pyString(text: string): string {
  if (!NEEDS_ESCAPE.test(text)) return `"${text}"`;
  let out = '"';
  let plain = 0;
  for (let i = 0; i < text.length; i++) {
    const unit = text.charCodeAt(i);
    if (unit >= 0x20 && unit <= 0x7e && unit !== 0x22 && unit !== 0x5c) continue;
    out += text.slice(plain, i);
    const char = text.charAt(i);
    out += SHORT_ESCAPES[char] ?? `\\u${unit.toString(16).padStart(4, "0")}`;
    plain = i + 1;
  }
  return `${out}${text.slice(plain)}"`;
}

/** A finite double as Python's `repr(float)` writes it: shortest digits, fixed
 * notation for exponents -4 ... 15, else `d.ddde+XX`. */
export function pyFloat(value: number): string {
  const [mantissa = "0", exp = "0"] = value.toExponential().split("e");
  const negative = mantissa.startsWith("-");
  const digits = mantissa.replace("-", "").replace(".", "");
  const exponent = Number(exp);
  let body: string;
  if (exponent >= -4 && exponent < 16) {
    if (exponent < 0) {
      body = `0.${"0".repeat(-exponent - 1)}${digits}`;
    } else if (digits.length <= exponent + 1) {
      body = `${digits}${"0".repeat(exponent + 1 - digits.length)}.0`;
    } else {
      body = `${digits.slice(0, exponent + 1)}.${digits.slice(exponent + 1)}`;
    }
  } else {
    const head = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
    const sign = exponent < 0 ? "-" : "+";
    body = `${head}e${sign}${String(Math.abs(exponent)).padStart(2, "0")}`;
  }
  return negative ? `-${body}` : body;
}

function byCodePoint(a: string, b: string): number {
  // Python sorts str keys by code point; JS compares UTF-16 units, which
  // orders the same unless a surrogate meets a unit above it (U+E000-U+FFFF).
  if (!(SURROGATE.test(a) || SURROGATE.test(b))) return a < b ? -1 : a > b ? 1 : 0;
  const x = Array.from(a, (c) => c.codePointAt(0) ?? 0);
  const y = Array.from(b, (c) => c.codePointAt(0) ?? 0);
  for (let i = 0; i < Math.min(x.length, y.length); i++) {
    const d = (x[i] ?? 0) - (y[i] ?? 0);
    if (d !== 0) return d;
  }
  return x.length - y.length;
}

function number(value: number): string {
  if (!Number.isFinite(value)) throw new RangeError("json: NaN and Infinity are not JSON");
  // What Python's json.loads makes of JSON.stringify's text, written back as
  // json.dumps writes it: integral values below 1e21 are ints (JS prints them
  // without an exponent), everything else is a float in Python's repr.
  return Number.isInteger(value) && Math.abs(value) < 1e21 ? String(value) : pyFloat(value);
}

/**
 * `value` as Python's `json.dumps(value, sort_keys=True, separators=(",", ":"),
 * allow_nan=False)`: the body bytes the Python writer sends for the same
 * payload, so the gateway's fingerprint matches whichever worker redoes a job.
 * Values follow `JSON.stringify` otherwise (`toJSON`, undefined members left out).
 */
export function canonicalJson(value: unknown): string {
  const text = write(value, false, []);
  if (text === undefined) throw new TypeError("json: the value has no JSON form");
  return text;
}

/** One value of `canonicalJson`; `open` holds the containers being written. */
function write(item: unknown, inArray: boolean, open: object[]): string | undefined {
  if (typeof item === "object" && item !== null && typeof (item as { toJSON?: unknown }).toJSON === "function") {
    item = (item as { toJSON(): unknown }).toJSON();
  }
  switch (typeof item) {
    case "string":
      return pyString(item);
    case "number":
      return number(item);
    case "bigint":
      return item.toString();
    case "boolean":
      return item ? "true" : "false";
    case "object":
      break;
    default: // undefined, functions, symbols: left out, or null in an array
      return inArray ? "null" : undefined;
  }
  if (item === null) return "null";
  if (open.includes(item)) throw new TypeError("json: circular structure");
  open.push(item);
  let out: string;
  if (Array.isArray(item)) {
    out = "[";
    for (let i = 0; i < item.length; i++) out += (i ? "," : "") + write(item[i], true, open);
    out += "]";
  } else {
    const record = item as Record<string, unknown>;
    out = "{";
    for (const key of Object.keys(record).sort(byCodePoint)) {
      const written = write(record[key], false, open);
      if (written !== undefined) out += `${out.length > 1 ? "," : ""}${pyString(key)}:${written}`;
    }
    out += "}";
  }
  open.pop();
  return out;
}
