/**
 * A BullMQ worker process for the tests: charges an order through the gateway
 * under `fencedProcessor`, and reports on stdout, one JSON line per event.
 *
 *   QUEUE=... GATEWAY=... [LEASE_URL=...] TTL=2 LOCK_MS=1000 NAME=a node bullmq-worker.js
 */

import { fencedProcessor } from "@sinkgate/leases/bullmq";
import { Worker } from "bullmq";

const env = (name: string, fallback?: string): string => {
  const value = process.env[name] ?? fallback;
  if (value === undefined) throw new Error(`${name} is not set`);
  return value;
};

const say = (event: Record<string, unknown>): void => {
  process.stdout.write(`${JSON.stringify({ worker: env("NAME"), ...event })}\n`);
};

const processor = fencedProcessor<{ order: number; amount: number }>(
  env("GATEWAY"),
  async (job, writer) => {
    say({ event: "start", generation: writer.lease.generation, job: job.id });
    try {
      const charge = await writer.post("rec", "/charges", {
        json: { order: job.data.order, amount: job.data.amount },
        step: "charge",
      });
      say({ event: "wrote", status: charge.status, replayed: charge.replayed });
      return { charged: charge.status, generation: writer.lease.generation };
    } catch (error) {
      say({ event: "write_failed", error: (error as Error).name, reason: (error as { reason?: string }).reason });
      throw error;
    }
  },
  { ttl: Number(env("TTL", "2")), leaseUrl: env("LEASE_URL", env("GATEWAY")), retryDelay: 0.2 },
);

const worker = new Worker(
  env("QUEUE"),
  async (job, token) => {
    const value = await processor(job, token);
    say({ event: "result", value });
    return value;
  },
  {
    connection: { host: "127.0.0.1", port: 6379 },
    lockDuration: Number(env("LOCK_MS", "1000")),
    stalledInterval: Number(env("STALLED_MS", "300")),
  },
);
worker.on("error", () => undefined); // a lost BullMQ lock after a stall is expected here
worker.on("ready", () => say({ event: "ready" }));
process.on("SIGTERM", () => {
  void worker.close(true).then(() => process.exit(0));
});
