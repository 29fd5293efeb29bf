// The BullMQ example's worker: an order is charged and its receipt booked,
// each at most once, under a lease per BullMQ job.
//
//   sinkgate serve --config examples/gateway.toml      # the gateway
//   python3 -m examples.ledger                          # the destination, on :9100
//   node examples/bullmq/worker.mjs                     # this worker (run two of them)
//   node examples/bullmq/producer.mjs 1003 1999         # send one order
//
// BullMQ runs a job again when it believes its worker stalled; the lease lets
// one run write at a time, and the step keys make a second run's writes
// replays of the first's.

import { realpathSync } from "node:fs";
import { pathToFileURL } from "node:url";
import { Worker } from "bullmq";
import { fencedProcessor } from "@sinkgate/leases/bullmq";

export const QUEUE = "sinkgate-orders";
// EXAMPLE_BROKER as the Celery and arq examples read it: redis[s]://[user:password@]host:port/db.
const broker = (() => {
  try {
    return new URL(process.env.EXAMPLE_BROKER ?? "redis://127.0.0.1:6379/0");
  } catch {
    // not the URL's own error: it quotes the URL, password and all
    throw new Error("EXAMPLE_BROKER is not a URL: expected redis[s]://[user:password@]host:port/db");
  }
})();
const decoded = (part, what) => {
  try {
    return decodeURIComponent(part);
  } catch {
    throw new Error(`EXAMPLE_BROKER: the ${what} has a malformed %-escape`);
  }
};
export const connection = {
  host: broker.hostname.replace(/^\[(.*)\]$/, "$1"),
  port: Number(broker.port || 6379),
  db: Number(broker.pathname.slice(1) || 0),
  ...(broker.username ? { username: decoded(broker.username, "user") } : {}),
  ...(broker.password ? { password: decoded(broker.password, "password") } : {}),
  ...(broker.protocol === "rediss:" ? { tls: {} } : {}),
};
const GATEWAY = process.env.EXAMPLE_GATEWAY ?? "http://127.0.0.1:8480";

// The destination's `retryable_statuses`: such an answer is relayed, not stored.
const RETRYABLE = new Set([429, 502, 503, 504]);
// Returning would complete the job with the entry never booked: throw, so the
// lease is given back and BullMQ runs the job again (the producer sets `attempts`).
const booked = (result) => {
  if (RETRYABLE.has(result.status)) throw new Error(`the ledger answered ${result.status}`);
  return result;
};

const shipOrder = fencedProcessor(
  GATEWAY,
  async (job, writer) => {
    const { orderId, amount } = job.data;
    const charge = booked(
      await writer.post("ledger", "/entries", { json: { order: orderId, charge: amount }, step: "charge" }),
    );
    const receipt = booked(
      await writer.post("ledger", "/entries", { json: { order: orderId, receipt: true }, step: "receipt" }),
    );
    return { charge: charge.status, receipt: receipt.status, replayed: charge.replayed };
  },
  { ttl: 10, jobId: (job) => `order-${job.data.orderId}` },
);

// Run as a program (not imported): compared as URLs of the real path, so a path
// with a space or through a symbolic link is still this file.
if (process.argv[1] && import.meta.url === pathToFileURL(realpathSync(process.argv[1])).href) {
  const worker = new Worker(QUEUE, shipOrder, { connection });
  worker.on("completed", (job, result) => console.log(`job ${job.id} (order ${job.data.orderId}):`, result));
  worker.on("failed", (job, error) => console.log(`job ${job?.id} failed: ${error.message}`));
  console.log(`worker on queue ${QUEUE}, writing through ${GATEWAY}`);
  for (const signal of ["SIGINT", "SIGTERM"]) {
    process.on(signal, () => void worker.close().then(() => process.exit(0)));
  }
}
