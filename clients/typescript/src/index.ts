/**
 * `@sinkgate/leases`: leases, `hold` and fenced writes through a sinkgate
 * gateway, for Node.js workers (SPEC 3.2). No runtime dependencies.
 */

export {
  type CallOptions,
  defaultOwner,
  type Lease,
  LeaseClient,
  type LeaseClientOptions,
  type LeaseRef,
  type LeaseState,
} from "./client.js";
export {
  BadWrite,
  DuplicateWrite,
  GatewayRejected,
  GatewayUnavailable,
  JobCompleted,
  LeaseError,
  type LeaseErrorFields,
  LeaseHeld,
  LeaseLost,
  type Problem,
  rejectionFromResponse,
  StaleWrite,
  StoreUnavailable,
} from "./errors.js";
export { type HeldLease, type HoldOptions, hold, type OnExit, RenewalSchedule } from "./hold.js";
export { canonicalJson } from "./json.js";
export { deriveKey } from "./key.js";
export {
  type Family,
  GATEWAY_TIMEOUT,
  GATEWAY_UNREACHABLE,
  LOST_REASONS,
  REASONS,
  type ReasonInfo,
} from "./reasons.js";
export type { Query } from "./target.js";
export { FencedWriter, type WriteOptions, type WriteResult, type WriterOptions } from "./writer.js";
