/**
 * `@sinkgate/leases/bullmq` on the real Redis and a real gateway: one job
 * delivered twice (a forced redelivery after a stalled worker) makes one
 * effect, and the stalled worker's late write is refused.
 */

import assert from "node:assert/strict";
import { type ChildProcess, spawn } from "node:child_process";
import { once } from "node:events";
import path from "node:path";
import { createInterface } from "node:readline";
import { after, before, describe, it } from "node:test";
import { fileURLToPath } from "node:url";
import { LeaseClient } from "@sinkgate/leases";
import { fencedProcessor, verdict } from "@sinkgate/leases/bullmq";
import { Queue, QueueEvents, Worker } from "bullmq";
import {
  deadUrl,
  destination,
  Gateway,
  gatewayMissing,
  missing,
  redisMissing,
  Upstream,
  unique,
  Wire,
} from "./harness.js";

const connection = { host: "127.0.0.1", port: 6379 };
const WORKER = path.join(path.dirname(fileURLToPath(import.meta.url)), "bullmq-worker.js");

const skip = missing(gatewayMissing() ?? (await redisMissing()));

type Event = Record<string, unknown> & { event: string };

/** A worker process and the events it reports. */
class WorkerProcess {
  readonly events: Event[] = [];
  readonly #waiters: Array<{ match: (e: Event) => boolean; resolve: (e: Event) => void }> = [];

  constructor(readonly child: ChildProcess) {
    const lines = createInterface({ input: child.stdout as NodeJS.ReadableStream });
    lines.on("line", (line) => {
      const event = JSON.parse(line) as Event;
      this.events.push(event);
      for (const waiter of this.#waiters.filter((w) => w.match(event))) {
        this.#waiters.splice(this.#waiters.indexOf(waiter), 1);
        waiter.resolve(event);
      }
    });
  }

  static start(env: Record<string, string>): WorkerProcess {
    const child = spawn(process.execPath, [WORKER], {
      env: { ...process.env, ...env },
      stdio: ["ignore", "pipe", "inherit"],
    });
    return new WorkerProcess(child);
  }

  next(event: string): Promise<Event> {
    const seen = this.events.find((e) => e.event === event);
    if (seen) return Promise.resolve(seen);
    return new Promise((resolve) => this.#waiters.push({ match: (e) => e.event === event, resolve }));
  }

  async stop(): Promise<void> {
    if (this.child.exitCode !== null || this.child.signalCode !== null) return;
    const exited = once(this.child, "exit");
    this.child.kill("SIGCONT");
    this.child.kill("SIGKILL");
    await exited;
  }
}

describe("BullMQ workers through a real gateway", { skip }, () => {
  let upstream: Upstream;
  let gateway: Gateway;
  let wire: Wire;
  const workers: WorkerProcess[] = [];
  const queues: Queue[] = [];
  const closing: Array<{ close(): Promise<unknown> }> = [];

  before(async () => {
    upstream = await Upstream.start();
    gateway = await Gateway.start({ rec: destination(upstream.url) });
    wire = await Wire.start(gateway.url);
  });

  after(async () => {
    await Promise.all(workers.map((w) => w.stop()));
    for (const queue of queues) await queue.obliterate({ force: true }).catch(() => undefined);
    await Promise.all([...closing, ...queues].map((c) => c.close()));
    await wire?.close();
    await gateway?.stop();
    await upstream?.close();
  });

  const queue = (): { name: string; queue: Queue; events: QueueEvents } => {
    const name = unique("sinkgate-orders");
    const q = new Queue(name, { connection });
    const events = new QueueEvents(name, { connection });
    queues.push(q);
    closing.push(events);
    return { name, queue: q, events };
  };

  it("one job delivered twice after a stalled worker: one effect, the stale write refused", async () => {
    const { name, queue: orders, events } = queue();
    await events.waitUntilReady();
    const jobId = unique("order-1001");
    // Worker A's writes cross a wire that holds them: its charge is on the way
    // when A stalls (SIGSTOP), so BullMQ's lock and the lease both run out.
    wire.holdWrites = true;
    const held = wire.nextHeld();
    const a = WorkerProcess.start({ QUEUE: name, GATEWAY: wire.url, NAME: "a", TTL: "1.5", LOCK_MS: "1000" });
    workers.push(a);
    await a.next("ready");
    const job = await orders.add("charge", { order: 1001, amount: 1999 }, { jobId });
    const started = await a.next("start");
    const write = await held;
    a.child.kill("SIGSTOP");

    // BullMQ redelivers the stalled job to B; B waits out A's lease, claims the
    // next generation, charges and completes.
    const b = WorkerProcess.start({ QUEUE: name, GATEWAY: gateway.url, NAME: "b", TTL: "5", LOCK_MS: "5000" });
    workers.push(b);
    const result = (await job.waitUntilFinished(events, 60_000)) as { charged: number; generation: number };
    assert.deepEqual(result, { charged: 201, generation: Number(started.generation) + 1 });

    // A's charge, generation N, finally reaches the gateway: refused, never forwarded.
    const late = await write.forward();
    assert.deepEqual(late, { status: 409, rejected: "stale_generation" });
    a.child.kill("SIGCONT");
    // A resumes: its own clock says the lease is gone (LeaseLost), or the refusal arrives first (StaleWrite).
    const ended = await Promise.race([a.next("wrote"), a.next("write_failed")]);
    assert.equal(ended.event, "write_failed");
    assert.ok(["LeaseLost", "StaleWrite"].includes(String(ended.error)), String(ended.error));

    const effects = upstream.of(jobId);
    assert.equal(effects.length, 1, "one effect at the upstream");
    assert.equal(effects[0]?.generation, result.generation);
    assert.equal((await new LeaseClient(gateway.url).get(jobId))?.state, "done");
    wire.holdWrites = false;
  });

  it("a duplicated job whose lease is done is skipped, not run twice", async () => {
    const { name, queue: orders, events } = queue();
    let runs = 0;
    const worker = new Worker(
      name,
      fencedProcessor<{ order: string }>(
        gateway.url,
        async (job, writer) => {
          runs += 1;
          const charge = await writer.post("rec", "/charges", { json: job.data, step: "charge" });
          return { charged: charge.status };
        },
        { ttl: 5, jobId: (job) => `order-${job.data.order}` },
      ),
      { connection },
    );
    closing.push(worker);
    const order = unique("o");
    const first = await orders.add("charge", { order });
    assert.deepEqual(await first.waitUntilFinished(events, 30_000), { charged: 201 });
    const second = await orders.add("charge", { order });
    assert.deepEqual(await second.waitUntilFinished(events, 30_000), {
      sinkgate: "job_completed",
      jobId: `order-${order}`,
    });
    assert.equal(runs, 1);
    assert.equal(upstream.of(`order-${order}`).length, 1);
  });

  it("an unreachable lease store uses up the job's attempts instead of delaying it for ever", async () => {
    // Delayed without an attempt, the job looped as long as the store was down.
    const { name, queue: runs, events } = queue();
    await events.waitUntilReady();
    let started = 0;
    const worker = new Worker(
      name,
      fencedProcessor(
        gateway.url,
        async () => {
          started += 1;
        },
        { ttl: 5, leaseUrl: await deadUrl() },
      ),
      { connection },
    );
    closing.push(worker);
    const job = await runs.add("run", {}, { attempts: 2, backoff: { type: "fixed", delay: 10 } });
    await assert.rejects(job.waitUntilFinished(events, 20_000), /cannot reach|StoreUnavailable|fetch failed/i);
    const failed = await runs.getJob(String(job.id));
    assert.equal(failed?.attemptsMade, 2);
    assert.equal(started, 0, "the body never ran without its lease");
  });

  it("BullMQ's cancellation stops the body and gives the lease back", async () => {
    const { name, queue: runs, events } = queue();
    await events.waitUntilReady();
    let bodySignal: AbortSignal | undefined;
    const worker = new Worker(
      name,
      fencedProcessor(
        gateway.url,
        async (_job, _writer, signal) => {
          bodySignal = signal;
          await new Promise(() => undefined); // works until stopped
        },
        { ttl: 5 },
      ),
      { connection },
    );
    closing.push(worker);
    const job = await runs.add("run", {});
    while (bodySignal === undefined) await new Promise((resolve) => setTimeout(resolve, 10));
    assert.equal(worker.cancelJob(String(job.id)), true);
    await assert.rejects(job.waitUntilFinished(events, 20_000));
    assert.equal(bodySignal.aborted, true);
    assert.equal((await new LeaseClient(gateway.url).get(String(job.id)))?.state, "free");
  });
});

describe("fencedProcessor's options", () => {
  it("are refused when the processor is made, not at every job's run", () => {
    const run = async () => undefined;
    // with a lease API of its own, the gateway's URL was checked only by each run's writer
    assert.throws(() => fencedProcessor("ftp://gw", run, { ttl: 5, leaseUrl: "http://leases" }), RangeError);
    assert.throws(() => fencedProcessor("http://gw", run, { ttl: 5, owner: "has space" }), RangeError);
    assert.throws(() => fencedProcessor("http://gw", run, { ttl: 5, writer: { wait: -3 } }), RangeError);
    assert.throws(
      () => fencedProcessor("http://gw", run, { ttl: 5, jobId: "nope" as unknown as () => string }),
      TypeError,
    );
    assert.throws(() => fencedProcessor("http://gw", "run" as unknown as typeof run, { ttl: 5 }), TypeError);
    // Each named as the caller wrote it: a bad leaseUrl was reported as gatewayUrl, and
    // no options at all as "Cannot read properties of undefined (reading 'ttl')".
    assert.throws(() => fencedProcessor("http://gw", run, { ttl: 5, leaseUrl: "ftp://x" }), /leaseUrl/);
    const none = undefined as unknown as { ttl: number };
    assert.throws(() => fencedProcessor("http://gw", run, none), /options must be an object/);
  });
});

describe("verdict", () => {
  it("maps what ended a run as the Celery and arq adapters do", async () => {
    const { JobCompleted, LeaseHeld, LeaseLost, StaleWrite, StoreUnavailable } = await import("@sinkgate/leases");
    assert.equal(verdict(new JobCompleted("j"))?.action, "done");
    assert.deepEqual(verdict(new LeaseHeld("j", "o", 3)), { action: "retry", reason: "lease_held", delay: 3 });
    assert.equal(verdict(new LeaseLost("j", 1, "job_completed"))?.action, "done");
    assert.equal(verdict(new LeaseLost("j", 1, "stale_generation"))?.action, "stop");
    assert.equal(verdict(new StaleWrite("owner_mismatch"))?.action, "stop");
    assert.deepEqual(verdict(new LeaseLost("j", 1, "lease_expired"), 2), {
      action: "retry",
      reason: "lease_expired",
      delay: 2,
    });
    assert.equal(verdict(new StoreUnavailable("down"))?.action, "retry");
    assert.equal(verdict(new Error("mine")), undefined);
  });
});
