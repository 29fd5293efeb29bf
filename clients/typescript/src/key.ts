/** Idempotency keys derived from (job id, step): the same in every run of a
 * job, whichever language the worker is written in. */

import { createHash } from "node:crypto";
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
  const digest = createHash("sha256").update(dumped, "latin1").digest("hex").slice(0, 32);
  const readable = (step.match(VISIBLE_RUNS) ?? []).join("_") || "step";
  return `${jobId.slice(0, 120)}:${readable.slice(0, 80)}:${digest}`;
}

/** An explicit idempotency key: 1-255 visible ASCII characters. */
export function validateKey(key: unknown): string {
  if (typeof key !== "string") throw new TypeError(`key must be a string, not ${typeName(key)}`);
  if (!KEY.test(key)) throw new RangeError("key must be 1-255 visible ASCII characters (0x21-0x7E)");
  return key;
}
