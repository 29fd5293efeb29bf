/**
 * The client against a real `sinkgate serve`: SPEC 1's worked example across two
 * workers, every error family, and the writer's retries.
 */

import assert from "node:assert/strict";
import { once } from "node:events";
import http from "node:http";
import type { AddressInfo } from "node:net";
import { after, before, describe, it } from "node:test";
import {
  BadWrite,
  DuplicateWrite,
  FencedWriter,
  GatewayUnavailable,
  hold,
  JobCompleted,
  LeaseClient,
  LeaseHeld,
  LeaseLost,
  StaleWrite,
  StoreUnavailable,
} from "@sinkgate/leases";
import { deadUrl, destination, Gateway, gatewayMissing, missing, Upstream, unique } from "./harness.js";
import { claimWhenFree } from "./lease.js";

const skip = missing(gatewayMissing());

describe("through a real gateway", { skip }, () => {
  let upstream: Upstream;
  let gateway: Gateway;
  let client: LeaseClient;
  let dead: string;

  before(async () => {
    upstream = await Upstream.start();
    dead = await deadUrl();
    gateway = await Gateway.start(
      {
        rec: destination(upstream.url),
        dead: destination(dead),
        tokened: destination(upstream.url, 'worker_tokens_env = "TS_TEST_WORKER_TOKENS"\n'),
      },
      { TS_TEST_WORKER_TOKENS: "secret-token" },
    );
    client = new LeaseClient(gateway.url);
  });

  after(async () => {
    await gateway?.stop();
    await upstream?.close();
  });

  it("runs SPEC 1's worked example across two workers", async () => {
    const job = unique("order");
    const a = await client.claim(job, { owner: "worker-a", ttl: 0.3 });
    // A pauses; its lease runs out by the store's clock and B claims the next generation.
    const b = await claimWhenFree(client, job, "worker-b", 30);
    assert.equal(b.generation, a.generation + 1);

    await assert.rejects(client.complete(a), (e: unknown) => e instanceof LeaseLost && e.reason === "stale_generation");
    const late = new FencedWriter(gateway.url, a);
    await assert.rejects(
      late.post("rec", "/charges", { json: { amount: 1999 }, step: "charge" }),
      (e: unknown) =>
        e instanceof StaleWrite && e.reason === "stale_generation" && e.currentGeneration === b.generation,
    );
    assert.equal(upstream.of(job).length, 0, "the destination never sees A's write");

    const writer = new FencedWriter(gateway.url, b);
    const first = await writer.post("rec", "/charges", { json: { amount: 1999 }, step: "charge" });
    const again = await writer.post("rec", "/charges", { json: { amount: 1999 }, step: "charge" });
    assert.deepEqual([first.status, first.replayed, again.status, again.replayed], [201, false, 201, true]);
    assert.deepEqual(again.json(), first.json());
    assert.equal(upstream.of(job).length, 1, "the destination sees B's write once");
    assert.equal(upstream.of(job)[0]?.generation, b.generation);
    const done = await client.complete(b);
    assert.equal(done.state, "done");
  });

  it("speaks the lease API: claim, renew, get, release, complete", async () => {
    const job = unique("lease");
    assert.equal(await client.get(job), null);
    const lease = await client.claim(job, { owner: "w", ttl: 5 });
    assert.deepEqual([lease.jobId, lease.owner, lease.state], [job, "w", "active"]);
    assert.ok(lease.leaseUntil instanceof Date && lease.expiresIn > 4 && lease.expiresIn <= 5);
    const renewed = await client.renew(lease, { ttl: 20 });
    assert.ok(renewed.expiresIn > 19);
    await assert.rejects(client.claim(job, { owner: "other", ttl: 5 }), (e: unknown) => {
      return e instanceof LeaseHeld && e.owner === "w" && e.currentGeneration === lease.generation && e.expiresIn > 0;
    });
    // SPEC 3.2: errors carry what the gateway sent: its status, detail and problem.
    await assert.rejects(client.claim(job, { owner: "other", ttl: 5 }), (e: unknown) => {
      assert.ok(e instanceof LeaseHeld);
      assert.equal(e.status, 409);
      assert.equal(e.problem.reason, "lease_held");
      assert.ok(e.detail.length > 0 && e.detail === e.problem.detail);
      return true;
    });
    assert.equal((await client.release(renewed)).state, "free");
    await assert.rejects(
      client.renew(renewed),
      (e: unknown) => e instanceof LeaseLost && e.reason === "lease_not_held",
    );
    const next = await client.claim(job, { owner: "w", ttl: 5 });
    assert.equal(next.generation, lease.generation + 1);
    await assert.rejects(
      client.renew({ ...next, owner: "intruder" }),
      (e: unknown) => e instanceof LeaseLost && e.reason === "owner_mismatch",
    );
    await assert.rejects(client.renew({ ...next, generation: next.generation + 5 }), (e: unknown) => {
      assert.ok(e instanceof LeaseLost && e.reason === "unknown_generation");
      assert.equal(e.status, 409);
      assert.equal(e.currentGeneration, next.generation);
      assert.equal(e.problem.reason, "unknown_generation");
      assert.ok(e.detail.length > 0);
      return true;
    });
    await client.complete(next);
    assert.equal((await client.get(job))?.state, "done");
    await assert.rejects(client.claim(job, { owner: "w", ttl: 5 }), (e: unknown) => {
      assert.ok(e instanceof JobCompleted);
      assert.equal(e.status, 409);
      assert.equal(e.problem.reason, "job_completed");
      assert.equal(e.currentGeneration, next.generation);
      return true;
    });
    await assert.rejects(client.renew(next), (e: unknown) => e instanceof LeaseLost && e.reason === "job_completed");
  });

  it("reaches the jobs named '.' and '..', not the paths they would resolve to", async () => {
    // Through fetch, POST /leases/%2E%2E/claim arrived as POST /claim.
    const held = await client.claim("..", { owner: "w", ttl: 30 });
    assert.deepEqual([held.jobId, held.state], ["..", "active"]);
    assert.equal(await client.get("."), null);
    await assert.rejects(client.claim("..", { owner: "v", ttl: 30 }), LeaseHeld);
    const dot = await client.claim(".", { owner: "w", ttl: 30 });
    assert.equal(dot.jobId, ".");
    assert.equal((await client.renew(held, { ttl: 30 })).jobId, "..");
    assert.equal((await client.release(dot)).state, "free");
    assert.equal((await client.complete(held)).state, "done");
    assert.deepEqual([(await client.get(".."))?.state, (await client.get("."))?.state], ["done", "free"]);
    // Their own way out fails as every other call does.
    await assert.rejects(new LeaseClient(dead).get(".."), StoreUnavailable);
    const stop = new AbortController();
    stop.abort(new Error("shutting down"));
    await assert.rejects(client.get("..", { signal: stop.signal }), /shutting down/);
  });

  it("refuses bad arguments with TypeError/RangeError and sends nothing", async () => {
    const job = unique("bad");
    await assert.rejects(client.claim("has space", { ttl: 5 }), RangeError);
    await assert.rejects(client.claim(job, { ttl: 0.01 }), RangeError);
    await assert.rejects(client.claim(job, { ttl: "5" as unknown as number }), TypeError);
    // Options that are no object, or a signal that is no AbortSignal, say so (they read
    // as `Cannot read properties of undefined` or `outers.map is not a function`).
    const noSignal = { ttl: 5, signal: "x" as unknown as AbortSignal };
    await assert.rejects(client.claim(job, noSignal), { name: "TypeError", message: /signal must be an AbortSignal/ });
    const none = undefined as unknown as { ttl: number };
    await assert.rejects(client.claim(job, none), { name: "TypeError", message: /options must be an object/ });
    await assert.rejects(client.get(job, { signal: {} as AbortSignal }), /signal must be an AbortSignal/);
    await assert.rejects(
      hold(client, job, none, () => 1),
      /options must be an object/,
    );
    await assert.rejects(
      hold(client, job, noSignal, () => 1),
      /signal must be an AbortSignal/,
    );
    assert.equal(await client.get(job), null, "nothing was claimed");
    // null options read as none, as before options were checked
    assert.equal(await client.get(job, null as unknown as Record<string, never>), null);
    assert.throws(() => new LeaseClient("ftp://x"), RangeError);
    assert.throws(() => new LeaseClient("http://u:p@127.0.0.1:1"), RangeError);
    const lease = await client.claim(job, { owner: "w", ttl: 5 });
    // a rejected promise, as every call's, never a synchronous throw that `.catch()` misses
    const renewals = [client.renew(lease, { ttl: 0 }), client.renew(lease, { ttl: "5" as unknown as number })];
    await assert.rejects(renewals[0] as Promise<unknown>, RangeError);
    await assert.rejects(renewals[1] as Promise<unknown>, TypeError);
    const writer = new FencedWriter(gateway.url, lease);
    const before = upstream.effects.length;
    await assert.rejects(writer.post("rec", "/a", { json: {}, step: "s", key: "k" }), TypeError);
    await assert.rejects(writer.post("rec", "/a", { json: {} }), TypeError);
    await assert.rejects(writer.post("rec", "/../admin", { json: {}, step: "s" }), RangeError);
    await assert.rejects(writer.post("a/b", "/a", { json: {}, step: "s" }), TypeError);
    await assert.rejects(writer.post("rec", "/a", { json: {}, key: "with space" }), RangeError);
    await assert.rejects(
      writer.post("rec", "/a", { json: {}, step: "s", headers: { "Fencing-Token": "9" } }),
      TypeError,
    );
    await assert.rejects(writer.post("rec", "/a", { json: { x: Number.NaN }, step: "s" }), RangeError);
    assert.throws(() => new FencedWriter(gateway.url, lease, { wait: 1.5 }), RangeError);
    const lost = new AbortController();
    lost.abort(new LeaseLost(job, lease.generation, "lease_expired"));
    await assert.rejects(
      new FencedWriter(gateway.url, lease, { signal: lost.signal }).post("rec", "/a", { json: {}, step: "s" }),
      (e: unknown) => e instanceof LeaseLost && e.reason === "lease_expired",
      "a writer under an aborted signal refuses to send",
    );
    assert.equal(upstream.effects.length, before, "nothing reached the upstream");
    await client.release(lease);
  });

  it("throws one error per family, with the contract's reason codes", async () => {
    const job = unique("families");
    const lease = await client.claim(job, { owner: "w", ttl: 30 });
    const writer = new FencedWriter(gateway.url, lease);
    await writer.post("rec", "/x", { json: { n: 1 }, key: `${job}-k` });

    // DuplicateWrite: the key again with another payload
    await assert.rejects(writer.post("rec", "/x", { json: { n: 2 }, key: `${job}-k` }), (e: unknown) => {
      return e instanceof DuplicateWrite && e.reason === "idempotency_key_reused" && e.status === 422;
    });
    // BadWrite: the request is wrong (unknown destination; missing worker token)
    await assert.rejects(writer.post("nowhere", "/x", { json: {}, step: "s" }), (e: unknown) => {
      return (
        e instanceof BadWrite && e.reason === "unknown_destination" && e.status === 404 && e.problem.status === 404
      );
    });
    await assert.rejects(writer.post("tokened", "/x", { json: {}, step: "s" }), (e: unknown) => {
      return e instanceof BadWrite && e.reason === "unauthorized" && e.status === 401;
    });
    // GatewayUnavailable: the upstream cannot be reached; the gateway cannot be reached
    await assert.rejects(writer.post("dead", "/x", { json: {}, step: "s" }), (e: unknown) => {
      return e instanceof GatewayUnavailable && e.reason === "upstream_unreachable" && e.status === 502;
    });
    await assert.rejects(new FencedWriter(dead, lease).post("rec", "/x", { json: {}, step: "s" }), (e: unknown) => {
      assert.ok(e instanceof GatewayUnavailable && e.reason === "gateway_unreachable" && e.status === undefined);
      // why, not only fetch's "fetch failed": undici keeps it in the cause
      assert.match(e.detail, /fetch failed \(connect ECONNREFUSED 127\.0\.0\.1:\d+\)/);
      assert.ok(e.cause instanceof TypeError);
      return true;
    });
    // StaleWrite: the lease is not the job's current one (here: completed)
    await client.complete(lease);
    await assert.rejects(writer.post("rec", "/x", { json: {}, step: "after" }), (e: unknown) => {
      return (
        e instanceof StaleWrite && e.reason === "job_completed" && e.status === 409 && typeof e.rejectionId === "number"
      );
    });
    // StoreUnavailable: the lease API cannot be reached
    await assert.rejects(new LeaseClient(dead).claim(job, { ttl: 5 }), (e: unknown) => {
      assert.ok(e instanceof StoreUnavailable && e.cause instanceof TypeError);
      assert.match(e.message, /failed: TypeError: fetch failed \(connect ECONNREFUSED 127\.0\.0\.1:\d+\)/);
      return true;
    });
  });

  it("retries a key in flight until its outcome is recorded, then gets the replay", async () => {
    const job = unique("inflight");
    const lease = await client.claim(job, { owner: "w", ttl: 30 });
    // A short `Prefer: wait` and many quick retries: correct whether or not the
    // gateway honours the preference.
    const writer = new FencedWriter(gateway.url, lease, { wait: 1, maxRetries: 50, maxRetryWait: 0.2 });
    const arrived = upstream.slowArrival();
    const first = writer.post("rec", "/slow", { json: { n: 1 }, step: "pay" });
    await arrived;
    const second = writer.post("rec", "/slow", { json: { n: 1 }, step: "pay" });
    setTimeout(() => upstream.release(), 300);
    const [one, two] = await Promise.all([first, second]);
    assert.deepEqual([one.replayed, two.replayed], [false, true]);
    assert.equal(upstream.of(job).length, 1);
    await client.complete(lease);
  });

  it("gives up on a key in flight after maxRetries with DuplicateWrite request_in_progress", async () => {
    const job = unique("inflight");
    const lease = await client.claim(job, { owner: "w", ttl: 30 });
    const writer = new FencedWriter(gateway.url, lease, { wait: 0, maxRetries: 1, maxRetryWait: 0 });
    const arrived = upstream.slowArrival();
    const first = writer.post("rec", "/slow", { json: { n: 1 }, step: "pay" });
    await arrived;
    await assert.rejects(writer.post("rec", "/slow", { json: { n: 1 }, step: "pay" }), (e: unknown) => {
      return e instanceof DuplicateWrite && e.reason === "request_in_progress";
    });
    upstream.release();
    await first;
    await client.complete(lease);
  });
});

describe("a lease API answer the client does not expect", () => {
  it("is StoreUnavailable carrying the answer's status, detail and problem (a wrong lease token)", async () => {
    const problem = { status: 401, detail: "missing or wrong lease API token", reason: "unauthorized" };
    const server = http.createServer((_req, res) => {
      res.writeHead(401, { "Content-Type": "application/problem+json", "Sinkgate-Rejected": "unauthorized" });
      res.end(JSON.stringify(problem));
    });
    server.listen(0, "127.0.0.1");
    await once(server, "listening");
    const client = new LeaseClient(`http://127.0.0.1:${(server.address() as AddressInfo).port}`, { token: "wrong" });
    try {
      await assert.rejects(client.claim("job-1", { ttl: 30 }), (e: unknown) => {
        assert.ok(e instanceof StoreUnavailable);
        assert.deepEqual(
          [e.reason, e.status, e.detail, e.problem],
          ["store_unavailable", 401, problem.detail, problem],
        );
        return true;
      });
    } finally {
      server.close();
    }
  });

  for (const [status, body, what] of [
    [404, '{"reason":"not_found","detail":"no route /leases/job-1/claim"}', "the admin listener's"],
    [201, '{"ok":true}', "an upstream's"],
    [404, "Not Found", "no JSON"],
    [401, "<html>Unauthorized</html>", "a proxy's sign-in page"],
  ] as const) {
    it(`names the URL as the likely cause of an answer no lease API gives (${what})`, async () => {
      const server = http.createServer((_req, res) => {
        res.writeHead(status, { "Content-Type": "application/json" });
        res.end(body);
      });
      server.listen(0, "127.0.0.1");
      await once(server, "listening");
      const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
      try {
        await assert.rejects(new LeaseClient(url).claim("job-1", { ttl: 30 }), (e: unknown) => {
          assert.ok(e instanceof StoreUnavailable);
          assert.match(e.message, /is http:\/\/127\.0\.0\.1:\d+ the gateway's main listener/);
          assert.equal(e.status, status); // a 401 or 403 says the configuration is wrong
          return true;
        });
      } finally {
        server.close();
      }
    });
  }

  it("is StoreUnavailable for a lease_until without an offset, which Date would read as local time", async () => {
    const lease = { job_id: "job-1", owner: "w", generation: 1, state: "active", expires_in: 30 };
    const server = http.createServer((req, res) => {
      const zoned = req.url?.endsWith("/claim") ? "2030-01-01T00:00:00" : "2030-01-01T00:00:00+01:00";
      res.writeHead(200, { "Content-Type": "application/json" });
      res.end(JSON.stringify({ ...lease, lease_until: zoned }));
    });
    server.listen(0, "127.0.0.1");
    await once(server, "listening");
    const client = new LeaseClient(`http://127.0.0.1:${(server.address() as AddressInfo).port}`);
    try {
      await assert.rejects(client.claim("job-1", { ttl: 30 }), (e: unknown) => {
        assert.ok(e instanceof StoreUnavailable);
        assert.equal(e.status, 200); // as Python's: the answer that was malformed
        return true;
      });
      const got = await client.get("job-1");
      assert.equal(got?.leaseUntil.toISOString(), "2029-12-31T23:00:00.000Z");
    } finally {
      server.close();
    }
  });
});
