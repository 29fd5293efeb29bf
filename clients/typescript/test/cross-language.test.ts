/**
 * A job redone by a worker in the other language sends the same key and the
 * same body bytes, so the destination sees one effect: Node after Python and
 * Python after Node, through a real gateway.
 */

import assert from "node:assert/strict";
import { once } from "node:events";
import { readFileSync } from "node:fs";
import http from "node:http";
import type { AddressInfo } from "node:net";
import path from "node:path";
import { after, before, describe, it } from "node:test";
import { FencedWriter, hold, type Lease, LeaseClient, LeaseHeld } from "@sinkgate/leases";
import { destination, Gateway, gatewayMissing, missing, pythonAsync, REPO, Upstream, unique } from "./harness.js";

// A Python worker: claims the job (waiting out a short-lived holder), charges it
// with the Python FencedWriter, and completes it unless told to "die" first.
const PYTHON_WORKER = `
import asyncio, json, sys
from leases import open_store, LeaseHeld
from leases.writer import FencedWriter

async def main(gateway, job, ttl, payload, finish):
    store = await open_store(gateway)
    try:
        for _ in range(100):
            try:
                lease = await store.claim(job, owner="python-worker", ttl=float(ttl))
                break
            except LeaseHeld as held:
                await asyncio.sleep(held.expires_in + 0.02)
        async with FencedWriter(gateway, lease) as writer:
            result = await writer.post("rec", "/charges", json=json.loads(payload), step="charge")
        if finish == "complete":
            await store.complete(lease)
        print(json.dumps({"status": result.status, "replayed": result.replayed, "generation": lease.generation}))
    finally:
        await store.close()

asyncio.run(main(*sys.argv[1:]))
`;

// Non-ASCII, an astral character, a float and nested keys out of order: the
// body bytes must still match the Python writer's.
const PAYLOAD = { order: "ö-1001 😀", amount: 19.99, items: [{ sku: "✉", qty: 2 }], currency: "EUR" };

const skip = missing(gatewayMissing());

describe("a Python worker and a Node worker redoing one job", { skip }, () => {
  let upstream: Upstream;
  let gateway: Gateway;
  let client: LeaseClient;

  before(async () => {
    upstream = await Upstream.start();
    gateway = await Gateway.start({ rec: destination(upstream.url) });
    client = new LeaseClient(gateway.url);
  });

  after(async () => {
    await gateway?.stop();
    await upstream?.close();
  });

  it("Node dies after its write, Python redoes the job: one effect", async () => {
    const job = unique("xlang");
    const lease = await client.claim(job, { owner: "node-worker", ttl: 0.3 });
    const first = await new FencedWriter(gateway.url, lease).post("rec", "/charges", {
      json: PYTHON_PAYLOAD(),
      step: "charge",
    });
    assert.equal(first.replayed, false);
    // the Node worker dies here: no completion; its lease runs out
    const redo = JSON.parse(
      await pythonAsync(PYTHON_WORKER, [gateway.url, job, "30", JSON.stringify(PAYLOAD), "complete"]),
    );
    assert.deepEqual(redo, { status: 201, replayed: true, generation: lease.generation + 1 });
    assert.equal(upstream.of(job).length, 1);
    assert.equal((await client.get(job))?.state, "done");
  });

  it("Python dies after its write, Node redoes the job under hold: one effect", async () => {
    const job = unique("xlang");
    const first = JSON.parse(
      await pythonAsync(PYTHON_WORKER, [gateway.url, job, "0.3", JSON.stringify(PAYLOAD), "die"]),
    );
    assert.equal(first.replayed, false);
    let result: { replayed: boolean; status: number } | undefined;
    for (let tries = 0; result === undefined && tries < 100; tries++) {
      try {
        result = await hold(client, job, { owner: "node-worker", ttl: 30 }, async (lease) => {
          const answer = await new FencedWriter(gateway.url, lease).post("rec", "/charges", {
            json: PAYLOAD,
            step: "charge",
          });
          return { replayed: answer.replayed, status: answer.status };
        });
      } catch (error) {
        if (!(error instanceof LeaseHeld)) throw error;
        await new Promise((resolve) => setTimeout(resolve, error.expiresIn * 1000 + 20));
      }
    }
    assert.deepEqual(result, { replayed: true, status: 201 });
    assert.equal(upstream.of(job).length, 1);
    assert.equal((await client.get(job))?.state, "done");
  });
});

// {path, params, sent}: what follows /to/{destination}, as both writers spell it;
// the Python writer's tests read the same table.
interface Spelling {
  path: string;
  params: Record<string, string> | Array<[string, string]> | null;
  sent: string;
}
const SPELLINGS = JSON.parse(
  readFileSync(path.join(REPO, "tests", "vectors", "write_spellings.json"), "utf8"),
) as Spelling[];

const PYTHON_SPELLER = `
import asyncio, json, sys
from datetime import UTC, datetime
from leases.model import Lease
from leases.writer import FencedWriter

async def main(url, table):
    lease = Lease("job-1", "w", 3, "active", datetime.now(UTC), 30.0)
    async with FencedWriter(url, lease, wait=0) as writer:
        for n, case in enumerate(json.loads(table)):
            await writer.post("d", case["path"], params=case["params"], step=str(n))

asyncio.run(main(*sys.argv[1:]))
`;

// The body forms, in Python: json, a str and bytes.
const PYTHON_BODIES = `
import asyncio, sys
from datetime import UTC, datetime
from leases.model import Lease
from leases.writer import FencedWriter

async def main(url):
    lease = Lease("job-1", "w", 3, "active", datetime.now(UTC), 30.0)
    async with FencedWriter(url, lease, wait=0) as writer:
        for n, body in enumerate(({"json": {"b": 1, "a": "é"}}, {"data": "é"}, {"data": b"\\x00\\xff"})):
            await writer.post("d", "/x", step=str(n), **body)

asyncio.run(main(*sys.argv[1:]))
`;

describe("the path, query and body both writers send", { skip }, () => {
  let server: http.Server;
  let url: string;
  const seen: string[] = [];
  const bodies: string[] = [];

  before(async () => {
    server = http.createServer(async (req, res) => {
      seen.push(req.url ?? "");
      const chunks: Buffer[] = [];
      for await (const chunk of req) chunks.push(chunk as Buffer);
      bodies.push(`${req.headers["content-type"]} ${Buffer.concat(chunks).toString("hex")}`);
      res.writeHead(201, { "Content-Type": "application/json" }).end("{}");
    });
    server.listen(0, "127.0.0.1");
    await once(server, "listening");
    url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  });

  after(() => {
    server.closeAllConnections();
    server.close();
  });

  it("is spelled alike, byte for byte", async () => {
    const writer = new FencedWriter(url, freshLease(), { wait: 0 });
    for (const [n, spelling] of SPELLINGS.entries()) {
      const query = spelling.params ? { query: spelling.params } : {};
      await writer.post("d", spelling.path, { body: "x", step: String(n), ...query });
    }
    const node = seen.splice(0);
    await pythonAsync(PYTHON_SPELLER, [url, JSON.stringify(SPELLINGS)]);
    const python = seen.splice(0);
    const expected = SPELLINGS.map(({ sent }) => `/to/d${sent}`);
    assert.deepEqual(node, expected);
    assert.deepEqual(python, expected);
  });

  it("sends each body form with the same bytes and content type", async () => {
    // the content type is in the gateway's fingerprint: bytes went without one from Node
    const writer = new FencedWriter(url, freshLease(), { wait: 0 });
    const forms = [{ json: { b: 1, a: "é" } }, { body: "é" }, { body: new Uint8Array([0, 255]) }];
    bodies.splice(0);
    for (const [n, form] of forms.entries()) await writer.post("d", "/x", { step: String(n), ...form });
    const node = bodies.splice(0);
    await pythonAsync(PYTHON_BODIES, [url]);
    assert.deepEqual(node, [
      `application/json ${Buffer.from('{"a":"\\u00e9","b":1}').toString("hex")}`, // as json.dumps
      `text/plain; charset=utf-8 ${Buffer.from("é").toString("hex")}`,
      "application/octet-stream 00ff",
    ]);
    assert.deepEqual(bodies.splice(0), node);
  });
});

/** A lease good for 30 s more, as the Python scripts above make theirs. */
function freshLease(): Lease {
  return {
    jobId: "job-1",
    owner: "w",
    generation: 3,
    state: "active",
    leaseUntil: new Date(Date.now() + 30_000),
    expiresIn: 30,
  };
}

function PYTHON_PAYLOAD(): typeof PAYLOAD {
  // the same payload, its keys written in another order
  return { currency: "EUR", items: [{ qty: 2, sku: "✉" }], amount: 19.99, order: "ö-1001 😀" };
}
