/**
 * The writer's retry rule against a scripted gateway: after an answer the
 * gateway already held (`Preference-Applied`) it asks again at once; after one
 * it did not hold, it waits the answer's `Retry-After` (as the Python writer).
 */

import assert from "node:assert/strict";
import { once } from "node:events";
import http from "node:http";
import type { AddressInfo } from "node:net";
import { after, before, describe, it } from "node:test";
import { FencedWriter, type Lease } from "@sinkgate/leases";

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
  readonly #server = http.createServer((request, response) => {
    request.resume();
    request.on("end", () => {
      this.seen += 1;
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
