/**
 * `hold` against a real gateway: renewal, completion, release, and the abort of
 * a write in flight once the lease may be gone - shown failing with the abort
 * not wired to the writer.
 */

import assert from "node:assert/strict";
import { getEventListeners } from "node:events";
import { after, before, describe, it } from "node:test";
import {
  FencedWriter,
  hold,
  type Lease,
  LeaseClient,
  LeaseLost,
  RenewalSchedule,
  StoreUnavailable,
} from "@sinkgate/leases";
import { destination, Gateway, gatewayMissing, missing, Upstream, unique, Wire } from "./harness.js";

describe("RenewalSchedule", () => {
  it("renews every fraction of the ttl and never sleeps past the deadline", () => {
    const schedule = new RenewalSchedule(30, 1 / 3, 0.05);
    assert.equal(schedule.deadline(100), 100 + 28.5);
    assert.equal(schedule.wait(100, 200), 10);
    assert.equal(schedule.wait(100, 104), 4);
    assert.equal(schedule.wait(100, 90), 0);
    assert.throws(() => new RenewalSchedule(30, 1.2), RangeError);
    assert.throws(() => new RenewalSchedule(30, 0.3, 0.3), RangeError);
    // The first renewal (27 s) after the local deadline (24 s): every hold would be lost.
    assert.throws(() => new RenewalSchedule(30, 0.9, 0.2), RangeError);
    assert.throws(() => new RenewalSchedule(30, 0.96, 0.05), RangeError);
    assert.throws(() => new RenewalSchedule(0.01), RangeError);
    assert.throws(() => new RenewalSchedule(30, "0.5" as unknown as number), TypeError);
    assert.throws(() => new RenewalSchedule(30, 0.5, "0.1" as unknown as number), TypeError);
  });
});

describe("hold's arguments", () => {
  it("refuses a client that is not one with TypeError, in words", async () => {
    // It said "client.claim is not a function".
    for (const client of [{}, null, "http://gateway:8480"]) {
      await assert.rejects(
        hold(client as unknown as LeaseClient, "job", { ttl: 5 }, async () => 1),
        (e: unknown) => e instanceof TypeError && /^client must be a LeaseClient, not /.test(e.message),
      );
    }
  });
});

const skip = missing(gatewayMissing());

// A window between the worker's local deadline (ttl * (1 - margin) after the
// last renewal was sent) and the store's expiry (ttl after it arrived) that is
// long beside a local request: the lease-loss tests below act inside it.
const WINDOW = { ttl: 3, renewFraction: 0.5, safetyMargin: 0.45 } as const;

describe("hold through a real gateway", { skip }, () => {
  let upstream: Upstream;
  let gateway: Gateway;
  let client: LeaseClient;
  let proxy: Wire;

  before(async () => {
    upstream = await Upstream.start();
    gateway = await Gateway.start({ rec: destination(upstream.url) });
    client = new LeaseClient(gateway.url);
  });

  after(async () => {
    await proxy?.close();
    await gateway?.stop();
    await upstream?.close();
  });

  const fresh = async (): Promise<Wire> => {
    await proxy?.close();
    proxy = await Wire.start(gateway.url);
    return proxy;
  };

  it("renews past the ttl, completes the job and resolves with the body's value", async () => {
    const job = unique("hold");
    const value = await hold(client, job, { owner: "w", ttl: 1.5 }, async (lease, signal) => {
      await new Promise((resolve) => setTimeout(resolve, 3000)); // 2 ttls: renewed meanwhile
      const writer = new FencedWriter(gateway.url, lease, { signal });
      return (await writer.post("rec", "/charges", { json: { amount: 5 }, step: "charge" })).status;
    });
    assert.equal(value, 201);
    const lease = await client.get(job);
    assert.equal(lease?.state, "done");
    assert.equal(upstream.of(job).length, 1);
  });

  it("releases the job and rethrows when the body throws", async () => {
    const job = unique("hold");
    await assert.rejects(
      hold(client, job, { ttl: 5 }, async () => {
        throw new Error("boom");
      }),
      /boom/,
    );
    assert.equal((await client.get(job))?.state, "free");
  });

  it("stops the body and releases the job when the worker shuts down", async () => {
    const job = unique("hold");
    const shutdown = new AbortController();
    let bodySignal: AbortSignal | undefined;
    const running = hold(client, job, { ttl: 5, signal: shutdown.signal }, async (_lease, signal) => {
      bodySignal = signal;
      await new Promise(() => undefined); // works forever
    });
    while (bodySignal === undefined) await new Promise((resolve) => setImmediate(resolve));
    shutdown.abort(new Error("shutting down"));
    await assert.rejects(running, /shutting down/);
    assert.equal(bodySignal.aborted, true);
    assert.equal((await client.get(job))?.state, "free");
  });

  it("stops waiting for a claim on the wire when the worker shuts down", async () => {
    // The claim never answers: without the outside signal heeded, hold waited for the
    // client's timeout (here 60 s) and then rejected with StoreUnavailable.
    const wire = await fresh();
    wire.hangLeases = true;
    const shutdown = new AbortController();
    const slow = new LeaseClient(wire.url, { timeout: 60 });
    const options = { ttl: 5, signal: shutdown.signal, cancelTimeout: 0.2 };
    let started = false;
    const running = hold(slow, unique("hold"), options, async () => {
      started = true;
    });
    while (wire.leaseCalls === 0) await new Promise((resolve) => setTimeout(resolve, 5));
    shutdown.abort(new Error("shutting down"));
    await assert.rejects(running, /shutting down/);
    assert.equal(started, false);
    assert.equal(getEventListeners(shutdown.signal, "abort").length, 0);
  });

  it("cuts a claim still unanswered after a shutdown at cancelTimeout", async () => {
    // The claim may still be granted, so hold waits for it to give it back - but
    // only for cancelTimeout: before, it stayed on the wire until the client's
    // timeout (here 60 s), keeping a shutting-down worker up.
    const wire = await fresh();
    wire.hangLeases = true;
    const shutdown = new AbortController();
    const slow = new LeaseClient(wire.url, { timeout: 60 });
    const running = hold(slow, unique("hold"), { ttl: 5, signal: shutdown.signal, cancelTimeout: 0.2 }, () => 1);
    while (wire.leaseCalls === 0) await new Promise((resolve) => setTimeout(resolve, 5));
    shutdown.abort(new Error("shutting down"));
    await assert.rejects(running, /shutting down/);
    for (let waited = 0; wire.leaseCallsCut === 0 && waited < 10_000; waited += 20) {
      await new Promise((resolve) => setTimeout(resolve, 20));
    }
    assert.equal(wire.leaseCallsCut, 1);
  });

  for (const exit of ["complete", "release after the body's error"] as const) {
    it(`cuts the exit's ${exit} still unanswered after a shutdown at cancelTimeout`, async () => {
      // Before, the abort was not heeded once the body had settled: the exit waited
      // the client's timeout (here 60 s) and rejected with StoreUnavailable.
      const wire = await fresh();
      const shutdown = new AbortController();
      const slow = new LeaseClient(wire.url, { timeout: 60 });
      const options = { ttl: 5, signal: shutdown.signal, cancelTimeout: 0.2 };
      const running = hold(slow, unique("hold"), options, () => {
        wire.hangLeases = true; // the claim was answered; the exit's call never is
        if (exit !== "complete") throw new Error("boom");
        return 1;
      });
      while (wire.leaseCalls < 2) await new Promise((resolve) => setTimeout(resolve, 5));
      const aborted = Date.now();
      shutdown.abort(new Error("shutting down"));
      await assert.rejects(running, /shutting down/);
      assert.ok(Date.now() - aborted < 5000, "the exit was cut at cancelTimeout");
      for (let waited = 0; wire.leaseCallsCut === 0 && waited < 10_000; waited += 20) {
        await new Promise((resolve) => setTimeout(resolve, 20));
      }
      assert.equal(wire.leaseCallsCut, 1);
      assert.equal(getEventListeners(shutdown.signal, "abort").length, 0);
    });
  }

  it("keeps the body's error when the release after it is refused", async () => {
    const job = unique("hold");
    const refusing = new LeaseClient(gateway.url);
    refusing.release = async () => {
      throw new RangeError("release refused");
    };
    await assert.rejects(
      hold(refusing, job, { ttl: 5 }, async () => {
        throw new Error("body failed");
      }),
      /body failed/,
    );
  });

  it("leaves no listener on a worker-wide shutdown signal once it has ended", async () => {
    const shutdown = new AbortController();
    for (let i = 0; i < 3; i++) {
      await hold(client, unique("hold"), { ttl: 5, signal: shutdown.signal }, async () => i);
    }
    assert.equal(getEventListeners(shutdown.signal, "abort").length, 0);
  });

  it("never starts the body when the claim's answer comes after the local deadline", async () => {
    const job = unique("hold");
    let calls = 0;
    const clock = (): number => (calls++ === 0 ? 0 : 1000); // the claim took "1000 s"
    let started = false;
    await assert.rejects(
      hold(client, job, { ttl: 5, monotonic: clock }, async () => {
        started = true;
      }),
      (e: unknown) => e instanceof LeaseLost && e.reason === "lease_expired",
    );
    assert.equal(started, false);
    assert.equal((await client.get(job))?.state, "free", "the late lease was given back");
  });

  it("cuts the write in flight when a renewal is refused: it never reaches the upstream", async () => {
    const job = unique("cut");
    const net = await fresh();
    net.holdWrites = true;
    const held = net.nextHeld();
    const running = hold(client, job, { owner: "w", ttl: 2 }, async (lease, signal) => {
      const writer = new FencedWriter(net.url, lease, { signal });
      return writer.post("rec", "/charges", { json: { amount: 7 }, step: "charge" });
    });
    const write = await held;
    const current = (await client.get(job)) as Lease;
    await client.release(current); // the lease is taken away: the next renewal is refused
    await assert.rejects(running, (e: unknown) => {
      // The gateway's refusal itself, with its status and problem, not a copy without them.
      assert.ok(e instanceof LeaseLost && e.reason === "lease_not_held");
      assert.equal(e.status, 409);
      assert.equal(e.problem.reason, "lease_not_held");
      return true;
    });
    assert.equal(await write.cut, true, "the worker cut its request");
    assert.equal(await write.forward(), undefined);
    assert.equal(upstream.of(job).length, 0);
    assert.notEqual((await client.get(job))?.state, "done", "the job is not completed");
  });

  it("cuts the write in flight on a lost lease when the writer was given a signal of its own", async () => {
    // The caller's signal (a worker's shutdown) used to replace the lease's: the
    // write then went on after the hold had rejected with LeaseLost.
    const job = unique("own-signal");
    const net = await fresh();
    net.holdWrites = true;
    const held = net.nextHeld();
    const shutdown = new AbortController();
    const running = hold(client, job, { owner: "w", ttl: 2 }, async (lease) => {
      const writer = new FencedWriter(net.url, lease, { signal: shutdown.signal });
      return writer.post("rec", "/charges", { json: { amount: 8 }, step: "charge" });
    });
    const write = await held;
    await client.release((await client.get(job)) as Lease);
    await assert.rejects(running, LeaseLost);
    assert.equal(await write.cut, true, "the worker cut its request");
    assert.equal(await write.forward(), undefined);
    assert.equal(upstream.of(job).length, 0);
    assert.equal(getEventListeners(shutdown.signal, "abort").length, 0);
  });

  /** A worker whose lease API is down while its write is held on the wire. */
  async function storeGoesAway(wired: boolean) {
    const job = unique(wired ? "wired" : "unwired");
    const net = await fresh();
    net.holdWrites = true;
    const held = net.nextHeld();
    const leases = new LeaseClient(net.url);
    // One renewal a second before the local deadline, then none: the loss's cause is
    // that renewal's 503, never a second one cut by the deadline on a slow machine.
    const window = { ttl: 4, renewFraction: 0.4, safetyMargin: 0.35 };
    const running = hold(leases, job, { owner: "w", ...window }, async (lease, signal) => {
      // Protection off: a writer given the lease's fields, not the hold's signal.
      const { jobId, owner, generation, state, leaseUntil, expiresIn } = lease;
      const plain: Lease = { jobId, owner, generation, state, leaseUntil, expiresIn };
      const writer = new FencedWriter(net.url, wired ? lease : plain, wired ? { signal } : {});
      net.failLeases = true; // from now on every renewal fails
      return writer.post("rec", "/charges", { json: { amount: 9 }, step: "charge" });
    });
    const write = await held;
    await assert.rejects(running, (e: unknown) => {
      assert.ok(e instanceof LeaseLost && e.reason === "store_unavailable");
      // why: the last renewal's failure (here the lease API's 503; a 401 of a wrong token alike),
      // with the Retry-After it was sent with
      assert.ok(e.cause instanceof StoreUnavailable && e.cause.status === 503);
      assert.equal(e.cause.retryAfter, 2);
      return true;
    });
    // By the store's clock the lease still runs: the gateway alone would let the write through.
    const seen = await client.get(job);
    assert.equal(seen?.state, "active");
    assert.ok((seen?.expiresIn ?? 0) > 0, "still inside the window the client must close itself");
    return { job, write };
  }

  it("cuts the write in flight when the lease API is unreachable until the local deadline", async () => {
    const { job, write } = await storeGoesAway(true);
    assert.equal(await write.cut, true, "the worker cut its request");
    assert.equal(await write.forward(), undefined);
    assert.equal(upstream.of(job).length, 0, "no effect under a lease that may be gone");
    assert.notEqual((await client.get(job))?.state, "done");
  });

  it("gives a renewal that never gets an answer up at the local deadline, not the client's timeout", async () => {
    const job = unique("hung");
    const net = await fresh();
    const leases = new LeaseClient(net.url, { timeout: 60 });
    const running = hold(leases, job, { owner: "w", ...WINDOW }, async (_lease, signal) => {
      net.hangLeases = true; // the next renewal is sent and never answered
      await new Promise((resolve) => signal.addEventListener("abort", resolve, { once: true }));
    });
    await assert.rejects(running, (e: unknown) => {
      assert.ok(e instanceof LeaseLost && e.reason === "store_unavailable");
      // The renewal cut at the deadline is the lease API's failure, not a bare timer error.
      assert.ok(e.cause instanceof StoreUnavailable, String(e.cause));
      assert.match(e.cause.message, /did not answer a renewal before the local deadline/);
      return true;
    });
    // Waiting out the client's 60 s instead, the store's lease would be long over by now.
    const seen = await client.get(job);
    assert.equal(seen?.state, "active");
    assert.ok((seen?.expiresIn ?? 0) > 0, "the hold ended inside the window the client must close itself");
  });

  it("SAFETY: with the abort not wired to the writer, the same late write makes an effect", async () => {
    const { job, write } = await storeGoesAway(false);
    const forwarded = await write.forward(); // nothing cut it: it goes on to the gateway
    assert.equal(forwarded?.status, 201, "the gateway accepted it: the lease had not run out in the store");
    assert.equal(upstream.of(job).length, 1, "an effect after the worker's own deadline: what the wiring prevents");
  });
});
