/** Idempotency keys derived from (job id, step): the same in every run of a
 * job, whichever language the worker is written in. */

import * as crypto from "node:crypto";
import { pyString } from "./json.js";
import { typeName, validateIdent } from "./validate.js";

const VISIBLE_RUNS = /[\x21-\x7e]+/g;
const KEY = /^[\x21-\x7e]{1,255}$/;

/**
 * The idempotency key of `step` of `jobId`, exactly as Python's
 * `leases.writer.derive_key` gives it (SPEC 3.2):
 * `"{jobId[:120]}:{readable[:80]}:{hex}"`, `readable` the runs of visible ASCII
 * in `step` joined by `_` (or `step`), `hex` the first 32 hex digits of SHA-256
 * over the UTF-8 of `json.dumps([jobId, step])`.
 */
export function deriveKey(jobId: string, step: string): string {
  validateIdent(jobId, "jobId");
  if (typeof step !== "string") throw new TypeError(`step must be a string, not ${typeName(step)}`);
  if (step.length === 0) throw new RangeError("step must be a non-empty string");
  // json.dumps escapes everything outside ASCII, so its output is ASCII and
  // its UTF-8 is the same bytes.
  const dumped = `[${pyString(jobId)}, ${pyString(step)}]`;
  const digest = sha256hex(dumped).slice(0, 32);
  const readable = (step.match(VISIBLE_RUNS) ?? []).join("_") || "step";
  return `${jobId.slice(0, 120)}:${readable.slice(0, 80)}:${digest}`;
}

// One-shot hashing (Node 20.12+) costs a third of a Hash object; older Nodes use one.
const oneShot = (crypto as { hash?: (algorithm: string, data: string, encoding: "hex") => string }).hash;

/** SHA-256 of an ASCII string, in hex. */
function sha256hex(text: string): string {
  return oneShot ? oneShot("sha256", text, "hex") : crypto.createHash("sha256").update(text, "latin1").digest("hex");
}

/** An explicit idempotency key: 1-255 visible ASCII characters. */
export function validateKey(key: unknown): string {
  if (typeof key !== "string") throw new TypeError(`key must be a string, not ${typeName(key)}`);
  if (!KEY.test(key)) throw new RangeError("key must be 1-255 visible ASCII characters (0x21-0x7E)");
  return key;
}
