/**
 * The writer's retry rule against a scripted gateway: after an answer the
 * gateway already held (`Preference-Applied`) it asks again at once; after one
 * it did not hold, it waits the answer's `Retry-After` (as the Python writer).
 */

import assert from "node:assert/strict";
import { once } from "node:events";
import { readFileSync } from "node:fs";
import http from "node:http";
import type { AddressInfo } from "node:net";
import path from "node:path";
import { after, before, describe, it } from "node:test";
import { FencedWriter, GatewayUnavailable, type Lease } from "@sinkgate/leases";
import { REPO } from "./harness.js";

const LEASE: Lease = {
  jobId: "job-1",
  owner: "w",
  generation: 3,
  state: "active",
  leaseUntil: new Date(Date.now() + 3_600_000),
  expiresIn: 3600,
};
const IN_PROGRESS = JSON.stringify({
  type: "about:blank",
  title: "request in progress",
  status: 409,
  reason: "request_in_progress",
});

/** Answers each write with the next scripted answer, and counts them. */
class ScriptedGateway {
  script: Array<Record<string, string> | null> = [];
  seen = 0;
  /** What each write arrived as: the request line's method and target. */
  readonly arrived: string[] = [];
  /** The Prefer header of each write. */
  readonly prefer: Array<string | undefined> = [];
  readonly #server = http.createServer((request, response) => {
    request.resume();
    request.on("end", () => {
      this.seen += 1;
      this.arrived.push(`${request.method} ${request.url}`);
      this.prefer.push(request.headers.prefer as string | undefined);
      const rejected = this.script.shift();
      if (rejected === undefined || rejected === null) {
        response.writeHead(201, { "Content-Type": "application/json" }).end("{}");
        return;
      }
      const headers = {
        "Content-Type": "application/problem+json",
        "Sinkgate-Rejected": "request_in_progress",
        ...rejected,
      };
      response.writeHead(409, headers).end(IN_PROGRESS);
    });
  });

  get url(): string {
    return `http://127.0.0.1:${(this.#server.address() as AddressInfo).port}`;
  }

  async start(): Promise<void> {
    this.#server.listen(0, "127.0.0.1");
    await once(this.#server, "listening");
  }

  close(): void {
    this.#server.closeAllConnections();
    this.#server.close();
  }
}

describe("the writer's retries", () => {
  const gateway = new ScriptedGateway();
  before(() => gateway.start());
  after(() => gateway.close());

  it("asks again at once after a refusal the gateway held the write for", { timeout: 10_000 }, async () => {
    // A Retry-After of an hour: honoured, it would time the test out.
    gateway.seen = 0;
    gateway.script = [{ "Retry-After": "3600", "Preference-Applied": "wait=5" }, null];
    const writer = new FencedWriter(gateway.url, LEASE, { maxRetryWait: 3600 });
    const answer = await writer.post("d", "/x", { json: {}, step: "s" });
    assert.equal(answer.status, 201);
    assert.equal(gateway.seen, 2);
  });

  it("counts a retry when the holds add up to the wait it stands for (a short max_wait)", async () => {
    // Holds of 1 s against a Retry-After of 10 capped at 5 s: five holds are one retry.
    const held = { "Retry-After": "10", "Preference-Applied": "wait=1" };
    gateway.seen = 0;
    gateway.script = [...Array(7).fill(held), null];
    const writer = new FencedWriter(gateway.url, LEASE, { maxRetries: 1 });
    assert.equal((await writer.post("d", "/x", { json: {}, step: "s" })).status, 201);
    assert.equal(gateway.seen, 8);

    gateway.seen = 0;
    gateway.script = Array(20).fill(held);
    await assert.rejects(writer.post("d", "/x", { json: {}, step: "s" }), { reason: "request_in_progress" });
    assert.equal(gateway.seen, 10); // holds that never end still run out of retries

    gateway.seen = 0; // a wait=0 (from no gateway of ours) held nothing: a whole retry each
    gateway.script = Array(20).fill({ "Retry-After": "10", "Preference-Applied": "wait=0" });
    await assert.rejects(writer.post("d", "/x", { json: {}, step: "s" }), { reason: "request_in_progress" });
    assert.equal(gateway.seen, 2);
    gateway.script = [];
  });

  it("waits Retry-After after a refusal the gateway did not hold", async () => {
    gateway.seen = 0;
    gateway.script = [{ "Retry-After": "3600" }, null];
    const stop = new AbortController();
    const writer = new FencedWriter(gateway.url, LEASE, { maxRetryWait: 3600, signal: stop.signal });
    const write = writer.post("d", "/x", { json: {}, step: "s" });
    while (gateway.seen < 1) await new Promise((resolve) => setTimeout(resolve, 10));
    await new Promise((resolve) => setTimeout(resolve, 200));
    assert.equal(gateway.seen, 1); // still waiting out the hour
    stop.abort(new Error("stopped"));
    await assert.rejects(write, /stopped/);
    assert.equal(gateway.seen, 1);
  });
});

describe("the writer's path", () => {
  const gateway = new ScriptedGateway();
  before(() => gateway.start());
  after(() => gateway.close());

  const write = (destination: string, path: string) =>
    new FencedWriter(gateway.url, LEASE, { token: "payments-secret" }).post(destination, path, {
      json: {},
      step: "s",
    });

  it("sends a backslash as %5C, as the Python writer: never read as '/' out of the route", async () => {
    // Read as '/', the first arrived as POST /to/refunds/r1, the second as POST /leases/job-1/release,
    // each with the payments destination's token.
    gateway.arrived.length = 0;
    await write("payments", "/orders/..\\..\\refunds\\r1");
    await write("payments", "/x\\..\\..\\..\\leases\\job-1\\release");
    await write("payments", "/a?q=\\");
    assert.deepEqual(gateway.arrived, [
      "POST /to/payments/orders/..%5C..%5Crefunds%5Cr1",
      "POST /to/payments/x%5C..%5C..%5C..%5Cleases%5Cjob-1%5Crelease",
      "POST /to/payments/a?q=%5C",
    ]);
  });

  it("refuses control characters and dot destinations with RangeError, sending nothing", async () => {
    gateway.seen = 0;
    // Tabs and newlines are dropped by the URL parser: ".\t." would be "..".
    for (const path of ["/a/.\t./b", ".\t.", "/a/.\n./..\r/b", "/a\x00", "/a\x7f", "\t/x"]) {
      await assert.rejects(write("payments", path), RangeError, JSON.stringify(path));
    }
    for (const destination of [".", ".."]) {
      await assert.rejects(write(destination, "/leases/job-1/release"), RangeError, destination);
    }
    assert.equal(gateway.seen, 0);
  });

  it("refuses what fetch cannot send (a method, a body on GET) with TypeError, sending nothing", async () => {
    // fetch threw its own TypeError, which read as GatewayUnavailable: retryable, for a call that never could be.
    gateway.seen = 0;
    const writer = new FencedWriter(gateway.url, LEASE, { maxRetries: 0 });
    for (const method of ["CONNECT", "trace", "TRACK"]) {
      await assert.rejects(writer.request(method, "payments", "/x", { step: "s" }), TypeError, method);
    }
    await assert.rejects(writer.request("GET", "payments", "/x", { json: { a: 1 }, step: "s" }), TypeError);
    await assert.rejects(writer.request("head", "payments", "/x", { body: "x", step: "s" }), TypeError);
    // No options at all: said so, not "Cannot read properties of undefined (reading 'query')".
    const none = undefined as unknown as Parameters<FencedWriter["post"]>[2];
    await assert.rejects(writer.post("payments", "/x", none), /options must be an object, not undefined/);
    assert.equal(gateway.seen, 0);
    assert.equal((await writer.request("GET", "payments", "/x", { step: "s" })).status, 201);
  });

  it("refuses headers and query values it cannot send with TypeError/RangeError, sending nothing", async () => {
    // fetch threw these as its own TypeError, reported as GatewayUnavailable (a retryable family),
    // or, for a string in place of the object, sent each of its characters as a header.
    gateway.seen = 0;
    const writer = new FencedWriter(gateway.url, LEASE);
    const post = (options: Record<string, unknown>) =>
      writer.post("payments", "/x", { step: "s", ...options } as Parameters<FencedWriter["post"]>[2]);
    const bad = [{ "X-A": "a\nb" }, { "X-A": "a\rb" }, { "X A": "1" }, { "": "1" }, { "X-A": "✉" }, { "X-A": "é" }];
    for (const headers of bad) {
      await assert.rejects(post({ headers }), RangeError, JSON.stringify(headers));
    }
    // fetch threw these too (or hung, for a Content-Length that is not the body's), as GatewayUnavailable
    const framing = [{ "Content-Length": "3" }, { "transfer-encoding": "chunked" }, { Expect: "100-continue" }];
    for (const headers of ["X-A: 1", { "X-A": 1 }, ...framing, { Connection: "close" }]) {
      await assert.rejects(post({ headers }), TypeError, JSON.stringify(headers));
    }
    for (const query of ["a=1", { a: 1.5 }, { a: null }, { a: true }]) {
      await assert.rejects(post({ query }), TypeError, JSON.stringify(query));
    }
    await assert.rejects(post({ query: { a: "b\udfff" } }), RangeError);
    await assert.rejects(
      post({}).then(() => writer.post("payments", "/\ud800", { step: "s" })),
      RangeError,
    );
    assert.equal(gateway.seen, 1); // the one well-formed write
  });

  it("takes a Map, Headers or URLSearchParams where it takes an object", async () => {
    // Object.entries of these is empty: the query and headers were dropped without a word.
    const seen: string[] = [];
    const server = http.createServer((req, res) => {
      seen.push(`${req.url} ${req.headers["x-a"]}`);
      res.writeHead(201).end();
    });
    server.listen(0, "127.0.0.1");
    await once(server, "listening");
    const writer = new FencedWriter(`http://127.0.0.1:${(server.address() as AddressInfo).port}`, LEASE, { wait: 0 });
    try {
      await writer.post("d", "/x", {
        step: "a",
        query: new URLSearchParams({ b: "2", a: "1" }),
        headers: new Headers({ "X-A": "h" }),
      });
      await writer.post("d", "/x", { step: "b", query: new Map([["a", "1"]]), headers: new Map([["X-A", "m"]]) });
      await writer.post("d", "/x", { step: "c", query: [["a", "1"]], headers: { "X-A": "o" } });
    } finally {
      server.close();
    }
    assert.deepEqual(seen, ["/to/d/x?a=1&b=2 h", "/to/d/x?a=1 m", "/to/d/x?a=1 o"]);
  });

  it("says a write whose connection was lost once sent may have reached the gateway", async () => {
    // "cannot reach the gateway" read as if nothing had been sent: a retry with
    // another key would then make a second effect.
    const server = http.createServer((req) => req.socket.destroy());
    server.listen(0, "127.0.0.1");
    await once(server, "listening");
    const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
    try {
      await assert.rejects(new FencedWriter(url, LEASE).post("d", "/x", { json: {}, step: "s" }), (e: unknown) => {
        assert.ok(e instanceof GatewayUnavailable && e.reason === "gateway_unreachable");
        assert.match(e.detail, /^no usable answer from the gateway, which may have the write: .*fetch failed/);
        return true;
      });
    } finally {
      server.close();
    }
    await assert.rejects(new FencedWriter(url, LEASE).post("d", "/x", { json: {}, step: "s" }), (e: unknown) => {
      assert.ok(e instanceof GatewayUnavailable);
      assert.match(e.detail, /^cannot reach the gateway: .*fetch failed \(connect ECONNREFUSED/);
      return true;
    });
  });
});

describe("the writer's Prefer", () => {
  const gateway = new ScriptedGateway();
  before(() => gateway.start());
  after(() => gateway.close());

  const write = (wait: number, prefer: Record<string, string>) =>
    new FencedWriter(gateway.url, LEASE, { wait }).post("d", "/x", { json: {}, step: "s", headers: prefer });

  it("sends the caller's preferences first, then its own wait=N (a PostgREST upstream's return=...)", async () => {
    gateway.prefer.length = 0;
    await write(5, { Prefer: "return=representation" });
    await write(5, { prefer: "return=minimal; a=1, handling=lenient" });
    await write(0, { Prefer: "return=representation" });
    await write(5, {});
    assert.deepEqual(gateway.prefer, [
      "return=representation, wait=5",
      "return=minimal; a=1, handling=lenient, wait=5",
      "return=representation",
      "wait=5",
    ]);
  });

  it("refuses a wait preference of the caller's with RangeError, sending nothing", async () => {
    gateway.seen = 0;
    // Read as sent, trimmed: padding past 1,024 characters hid the caller's wait.
    const padded = `${" ".repeat(1100)}wait=1`;
    for (const wait of [5, 0]) {
      for (const prefer of [
        "wait=600",
        "return=minimal, WAIT = 3",
        "wait;x=1",
        padded,
        `wait=1, x=${"y".repeat(1100)}`,
      ]) {
        await assert.rejects(write(wait, { Prefer: prefer }), /the writer sets the wait preference/, prefer);
      }
    }
    // Readable, but too long with the writer's wait: the length is the trouble.
    await assert.rejects(write(5, { Prefer: `a=${"x".repeat(600)}, b=${"y".repeat(600)}` }), /reads at most 1024/);
    assert.equal(gateway.seen, 0);
  });

  it("takes a timeout longer than a Node timer keeps (2^31 - 1 ms) as that longest one", async () => {
    // Past it, setTimeout fires after 1 ms: every write failed at once as gateway_timeout.
    gateway.prefer.length = 0;
    const writer = new FencedWriter(gateway.url, LEASE, { timeout: 3e6, maxRetryWait: 1e7 });
    assert.equal((await writer.post("d", "/x", { json: {}, step: "long" })).status, 201);
    assert.equal(gateway.prefer.length, 1);
  });

  it("reads the caller's Prefer as the Python writer and the gateway do: a quoted comma separates nothing", async () => {
    // Split on every comma, handling="a, wait=3" was refused here and sent by Python.
    // A value the gateway would not read to its end hid the writer's wait after it.
    const rows = JSON.parse(readFileSync(path.join(REPO, "tests", "vectors", "prefer_names.json"), "utf8")) as Array<{
      value: string;
      names: string[];
      whole: boolean;
    }>;
    // biome-ignore lint/suspicious/noControlCharactersInRegex: the rows no header can carry
    const control = /[\x00-\x08\x0a-\x1f\x7f]/;
    for (const { value } of rows.filter((row) => control.test(row.value))) {
      // fetch refuses them, so the writer does, as a bad argument (it was GatewayUnavailable)
      await assert.rejects(write(0, { Prefer: value }), RangeError, JSON.stringify(value));
    }
    // Rows past 1,024 characters: the gateway does not read them, the writer does
    // (the tests above); here the two read alike.
    const sendable = rows.filter(
      (row) => row.value.trim() !== "" && !control.test(row.value) && row.value.length <= 1024,
    );
    assert.ok(sendable.some((row) => !row.whole && !row.names.includes("wait")));
    for (const { value, names, whole } of sendable) {
      gateway.prefer.length = 0;
      if (names.includes("wait") || !whole) {
        await assert.rejects(write(5, { Prefer: value }), RangeError, value);
        assert.deepEqual(gateway.prefer, [], value);
      } else {
        await write(5, { Prefer: value });
        assert.deepEqual(gateway.prefer, [`${value.trim()}, wait=5`], value);
      }
      if (!names.includes("wait")) {
        gateway.prefer.length = 0;
        await write(0, { Prefer: value }); // no wait of the writer's: nothing to hide
        assert.equal(gateway.prefer.length, 1, value);
      }
    }
  });
});
