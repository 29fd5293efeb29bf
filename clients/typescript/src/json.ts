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
  const seen = new Set<object>();
  const write = (item: unknown, inArray: boolean): string | undefined => {
    if (item !== null && typeof item === "object" && "toJSON" in item && typeof item.toJSON === "function") {
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
      case "undefined":
      case "function":
      case "symbol":
        return inArray ? "null" : undefined;
      default:
        break;
    }
    if (item === null) return "null";
    const obj = item as object;
    if (seen.has(obj)) throw new TypeError("json: circular structure");
    seen.add(obj);
    let out: string;
    if (Array.isArray(obj)) {
      out = `[${obj.map((element) => write(element, true)).join(",")}]`;
    } else {
      const members: string[] = [];
      const record = obj as Record<string, unknown>;
      for (const key of Object.keys(record).sort(byCodePoint)) {
        const written = write(record[key], false);
        if (written !== undefined) members.push(`${pyString(key)}:${written}`);
      }
      out = `{${members.join(",")}}`;
    }
    seen.delete(obj);
    return out;
  };
  const text = write(value, false);
  if (text === undefined) throw new TypeError("json: the value has no JSON form");
  return text;
}
