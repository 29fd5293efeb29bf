// Client CPU per write of @sinkgate/leases's FencedWriter beside a bare fetch
// through the same gateway, measured side by side in one Node process.
//
//   npm --prefix clients/typescript ci          # builds the client
//   node bench/ts_client.mjs [--writes 10000] [--block 500]
//
// Starts `python3 -m bench.upstream` and `sinkgate serve` (Python from
// SINKGATE_PYTHON, default python3) on a temporary SQLite store, claims one
// lease, then sends the writes one at a time in alternating blocks: a bare
// fetch with the fencing headers set by hand, and `writer.post(..., {json,
// step})` bound to an abort signal as under `hold` (derived key,
// Python-compatible JSON, Prefer: wait, the abort wiring, checks). CPU is
// this process's user + system time (process.cpuUsage), so the gateway's and
// the upstream's work is not counted; the difference per write is what the
// client adds. Every write has its own key, so none is a replay.

import { spawn } from "node:child_process";
import { mkdtempSync, mkdirSync, rmSync, writeFileSync } from "node:fs";
import net from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import { FencedWriter, LeaseClient } from "../clients/typescript/dist/index.js";

const ROOT = path.dirname(path.dirname(fileURLToPath(import.meta.url)));
const PYTHON = process.env.SINKGATE_PYTHON || "python3";
const { values } = parseArgs({ options: { writes: { type: "string", default: "10000" }, block: { type: "string", default: "500" } } });
const WRITES = Number(values.writes);
const BLOCK = Number(values.block);

async function freePort() {
  const server = net.createServer().listen(0, "127.0.0.1");
  await new Promise((resolve) => server.once("listening", resolve));
  const { port } = server.address();
  await new Promise((resolve) => server.close(resolve));
  return port;
}

function waitFor(child, pattern) {
  return new Promise((resolve, reject) => {
    let seen = "";
    const look = (text) => {
      seen += text;
      const match = seen.match(pattern);
      if (match) resolve(match);
    };
    child.stdout?.setEncoding("utf8").on("data", look);
    child.stderr?.setEncoding("utf8").on("data", look);
    child.on("exit", (code) => reject(new Error(`${child.spawnargs.join(" ")} exited ${code}:\n${seen}`)));
  });
}

async function start() {
  const upstreamPort = await freePort();
  const upstream = spawn(PYTHON, ["-m", "bench.upstream", "--port", String(upstreamPort)], { cwd: ROOT });
  await waitFor(upstream, /upstream listening/);
  const dir = mkdtempSync(path.join(tmpdir(), "sinkgate-bench-ts-"));
  mkdirSync(path.join(dir, "destinations"));
  writeFileSync(
    path.join(dir, "gateway.toml"),
    '[server]\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n[store]\nurl = "sqlite:///bench.db"\n[destinations]\ndir = "destinations"\n',
  );
  writeFileSync(path.join(dir, "destinations", "rec.toml"), `upstream = "http://127.0.0.1:${upstreamPort}"\n`);
  const gateway = spawn(PYTHON, ["-m", "gateway", "serve", "--config", path.join(dir, "gateway.toml")], { cwd: ROOT });
  const [, listen] = await waitFor(gateway, /"listen":\s*"([^"]+)"/);
  return {
    url: `http://${listen}`,
    stop: () => {
      gateway.kill("SIGTERM");
      upstream.kill("SIGTERM");
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

const payload = (i) => ({ order: `order-${i}`, amount: 1999, currency: "EUR", items: [{ sku: "a-1", qty: 2 }] });

function bare(url, lease) {
  return async (i) => {
    const resp = await fetch(`${url}/to/rec/charges`, {
      method: "POST",
      headers: {
        "Content-Type": "application/json",
        "Fencing-Job": lease.jobId,
        "Fencing-Token": String(lease.generation),
        "Fencing-Owner": lease.owner,
        "Idempotency-Key": `bare-${lease.jobId}-${i}`,
      },
      body: JSON.stringify(payload(i)),
    });
    await resp.arrayBuffer();
    if (resp.status !== 200) throw new Error(`bare write answered ${resp.status}`);
  };
}

function fenced(url, lease) {
  // bound to a signal, as under hold(): the abort wiring is part of the cost
  const writer = new FencedWriter(url, lease, { signal: new AbortController().signal });
  return async (i) => {
    const result = await writer.post("rec", "/charges", { json: payload(i), step: `charge-${i}` });
    if (result.status !== 200 || result.replayed) throw new Error(`fenced write answered ${result.status}`);
  };
}

async function block(send, from, count) {
  const before = process.cpuUsage();
  const started = performance.now();
  for (let i = from; i < from + count; i++) await send(i);
  const cpu = process.cpuUsage(before);
  return { cpuMs: (cpu.user + cpu.system) / 1000, wallMs: performance.now() - started };
}

const gateway = await start();
try {
  const lease = await new LeaseClient(gateway.url).claim(`bench-${process.pid}-${Date.now()}`, { ttl: 3600 });
  const kinds = { bare: bare(gateway.url, lease), fenced: fenced(gateway.url, lease) };
  const totals = { bare: { cpuMs: 0, wallMs: 0, n: 0 }, fenced: { cpuMs: 0, wallMs: 0, n: 0 } };
  await block(kinds.bare, -1000, 500); // warm-up: connections, JIT
  await block(kinds.fenced, -1000, 500);
  for (let from = 0; from < WRITES; from += BLOCK) {
    const count = Math.min(BLOCK, WRITES - from);
    for (const kind of (from / BLOCK) % 2 ? ["fenced", "bare"] : ["bare", "fenced"]) {
      const took = await block(kinds[kind], from, count);
      totals[kind].cpuMs += took.cpuMs;
      totals[kind].wallMs += took.wallMs;
      totals[kind].n += count;
    }
  }
  const per = (kind, field) => totals[kind][field] / totals[kind].n;
  const result = {
    writes_each: WRITES,
    bare_cpu_ms_per_write: Number(per("bare", "cpuMs").toFixed(4)),
    fenced_cpu_ms_per_write: Number(per("fenced", "cpuMs").toFixed(4)),
    added_cpu_ms_per_write: Number((per("fenced", "cpuMs") - per("bare", "cpuMs")).toFixed(4)),
    bare_wall_ms_per_write: Number(per("bare", "wallMs").toFixed(3)),
    fenced_wall_ms_per_write: Number(per("fenced", "wallMs").toFixed(3)),
    node: process.version,
  };
  console.log(`client CPU per write: bare fetch ${result.bare_cpu_ms_per_write} ms, FencedWriter ${result.fenced_cpu_ms_per_write} ms`);
  console.log(`added by the client: ${result.added_cpu_ms_per_write} ms per write (target <= 0.2 ms)`);
  console.log(JSON.stringify(result));
} finally {
  gateway.stop();
}
