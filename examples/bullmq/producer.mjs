// Enqueue an order for the BullMQ example's worker and print what its run returned.
//
//   node examples/bullmq/producer.mjs 1003 1999 [--twice]
//
// `--twice` enqueues the same order as two jobs, which workers may run at once: one
// charges it, and the other returns { sinkgate: "job_completed", ... } instead of
// charging again. Either may print first.

import { Queue, QueueEvents } from "bullmq";
import { connection, QUEUE } from "./worker.mjs";

const [orderId, amount] = process.argv.slice(2, 4).map(Number);
if (!Number.isInteger(orderId) || !Number.isInteger(amount)) {
  console.error("usage: node producer.mjs ORDER_ID AMOUNT [--twice]");
  process.exit(2);
}
const times = process.argv.includes("--twice") ? 2 : 1;
const queue = new Queue(QUEUE, { connection });
const events = new QueueEvents(QUEUE, { connection });
try {
  await events.waitUntilReady();
  // Both jobs enqueued before either is awaited, so two workers may run them at once.
  const jobs = [];
  // `attempts`: a run that met a busy ledger throws, and BullMQ runs it again.
  const retried = { attempts: 5, backoff: { type: "exponential", delay: 1000 } };
  for (let i = 0; i < times; i++) jobs.push(await queue.add("ship-order", { orderId, amount }, retried));
  for (const job of jobs) {
    console.log(`order ${orderId}, BullMQ job ${job.id}:`, await job.waitUntilFinished(events, 60_000));
  }
} finally {
  await events.close();
  await queue.close();
}
