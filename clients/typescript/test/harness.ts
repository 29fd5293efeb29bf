/**
 * What the tests run against: a real `sinkgate serve` (Python from
 * `SINKGATE_PYTHON`, default `python3`), a recording upstream, a proxy that can
 * hold writes on the wire or fail lease calls, and the local Redis.
 *
 * A service that is not there skips the tests that need it, with the reason;
 * under CI=true it fails them instead.
 */

import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { once } from "node:events";
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import http from "node:http";
import net from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";

export const PYTHON = process.env.SINKGATE_PYTHON || "python3";

// The gateway and `leases` of this checkout come first on Python's path (npm runs
// the tests in clients/typescript): an installed copy from elsewhere must not be
// the one these tests compare against.
/** The repository's top (the tests run from `clients/typescript`). */
export const REPO = path.resolve(process.cwd(), "..", "..");
const PYTHON_ENV: NodeJS.ProcessEnv = existsSync(path.join(REPO, "gateway", "__init__.py"))
  ? { ...process.env, PYTHONPATH: [REPO, process.env.PYTHONPATH].filter(Boolean).join(path.delimiter) }
  : process.env;
export const CI = process.env.CI === "true";

/** `reason` if a service is missing: a skip reason outside CI, a failure under it. */
export function missing(reason: string | undefined): string | false {
  if (reason === undefined) return false;
  if (CI) throw new Error(`${reason} (CI=true: a missing service fails the run)`);
  return reason;
}

export function unique(prefix: string): string {
  return `${prefix}-${randomBytes(4).toString("hex")}`;
}

/** Why the gateway cannot be started here, or undefined. */
export function gatewayMissing(): string | undefined {
  const probe = spawnSync(PYTHON, ["-c", "import gateway, leases"], { encoding: "utf8", env: PYTHON_ENV });
  if (probe.error) return `no Python at ${PYTHON}: ${probe.error.message}`;
  return probe.status === 0 ? undefined : `${PYTHON} cannot import gateway: ${probe.stderr.trim().split("\n").pop()}`;
}

/** Why Redis at 127.0.0.1:6379 cannot be reached, or undefined. */
export async function redisMissing(port = 6379): Promise<string | undefined> {
  return new Promise((resolve) => {
    const socket = net.connect(port, "127.0.0.1");
    socket.setTimeout(2000);
    socket.on("connect", () => {
      socket.end();
      resolve(undefined);
    });
    socket.on("timeout", () => {
      socket.destroy();
      resolve(`Redis at 127.0.0.1:${port} does not answer`);
    });
    socket.on("error", (error) => resolve(`Redis at 127.0.0.1:${port} is unreachable: ${error.message}`));
  });
}

// --- the recording upstream ---------------------------------------------------------------

export interface Effect {
  readonly n: number;
  readonly method: string;
  readonly path: string;
  readonly job: string | undefined;
  readonly generation: number | undefined;
  readonly owner: string | undefined;
  readonly key: string | undefined;
  readonly body: string;
}

/** Applies every request it gets (one effect each, nothing deduplicated) and answers
 * 201 with the effect; requests whose path starts with `/slow` wait for `release()`. */
export class Upstream {
  readonly effects: Effect[] = [];
  readonly #held: Array<() => void> = [];
  #arrived: Array<() => void> = [];

  private constructor(
    readonly server: http.Server,
    readonly url: string,
  ) {}

  static async start(): Promise<Upstream> {
    let upstream: Upstream | undefined;
    const server = http.createServer((req, res) => upstream?.handle(req, res));
    server.listen(0, "127.0.0.1");
    await once(server, "listening");
    const port = (server.address() as net.AddressInfo).port;
    upstream = new Upstream(server, `http://127.0.0.1:${port}`);
    return upstream;
  }

  private async handle(req: http.IncomingMessage, res: http.ServerResponse): Promise<void> {
    const chunks: Buffer[] = [];
    for await (const chunk of req) chunks.push(chunk as Buffer);
    const url = req.url ?? "/";
    if (url.startsWith("/slow")) {
      const arrived = this.#arrived;
      this.#arrived = [];
      for (const wake of arrived) wake();
      await new Promise<void>((resolve) => this.#held.push(resolve));
    }
    const token = req.headers["fencing-token"];
    const effect: Effect = {
      n: this.effects.length + 1,
      method: req.method ?? "",
      path: url,
      job: header(req, "fencing-job"),
      generation: typeof token === "string" ? Number(token) : undefined,
      owner: header(req, "fencing-owner"),
      key: header(req, "idempotency-key"),
      body: Buffer.concat(chunks).toString("utf8"),
    };
    this.effects.push(effect);
    res.writeHead(201, { "Content-Type": "application/json" });
    res.end(JSON.stringify(effect));
  }

  /** Effects of one job. */
  of(job: string): Effect[] {
    return this.effects.filter((effect) => effect.job === job);
  }

  /** Resolves when the next `/slow` request has arrived. */
  slowArrival(): Promise<void> {
    return new Promise((resolve) => this.#arrived.push(resolve));
  }

  /** Let every held `/slow` request be applied. */
  release(): void {
    for (const go of this.#held.splice(0)) go();
  }

  async close(): Promise<void> {
    this.release();
    this.server.closeAllConnections();
    this.server.close();
  }
}

function header(req: http.IncomingMessage, name: string): string | undefined {
  const value = req.headers[name];
  return typeof value === "string" ? value : undefined;
}

// --- the gateway ----------------------------------------------------------------------

export class Gateway {
  private constructor(
    readonly process: ChildProcess,
    readonly url: string,
    readonly dir: string,
    readonly log: string[],
  ) {}

  /** `sinkgate serve` on a fresh SQLite store; `destinations` maps name -> TOML body. */
  static async start(destinations: Record<string, string>, env: Record<string, string> = {}): Promise<Gateway> {
    const dir = mkdtempSync(path.join(tmpdir(), "sinkgate-ts-"));
    mkdirSync(path.join(dir, "destinations"));
    writeFileSync(
      path.join(dir, "gateway.toml"),
      [
        "[server]",
        'listen = "127.0.0.1:0"',
        'admin_listen = "127.0.0.1:0"',
        "[store]",
        'url = "sqlite:///gateway.db"',
        "[destinations]",
        'dir = "destinations"',
        "",
      ].join("\n"),
    );
    for (const [name, body] of Object.entries(destinations)) {
      writeFileSync(path.join(dir, "destinations", `${name}.toml`), body);
    }
    const child = spawn(PYTHON, ["-m", "gateway", "serve", "--config", path.join(dir, "gateway.toml")], {
      stdio: ["ignore", "ignore", "pipe"],
      env: { ...PYTHON_ENV, ...env },
    });
    const log: string[] = [];
    const listen = await new Promise<string>((resolve, reject) => {
      let buffered = "";
      child.stderr?.setEncoding("utf8");
      child.stderr?.on("data", (text: string) => {
        buffered += text;
        const lines = buffered.split("\n");
        buffered = lines.pop() ?? "";
        for (const line of lines) {
          log.push(line);
          if (line.includes('"serving"')) {
            try {
              resolve(String((JSON.parse(line) as { listen: string }).listen));
            } catch (error) {
              reject(error);
            }
          }
        }
      });
      child.on("exit", (code) => reject(new Error(`sinkgate serve exited ${code}:\n${log.join("\n")}`)));
    });
    return new Gateway(child, `http://${listen}`, dir, log);
  }

  async stop(): Promise<void> {
    if (this.process.exitCode === null) {
      const exited = once(this.process, "exit");
      this.process.kill("SIGTERM");
      await exited;
    }
    rmSync(this.dir, { recursive: true, force: true });
  }
}

/** A destination's TOML: `upstream`, fencing by lease, short timeouts. */
export function destination(upstream: string, extra = ""): string {
  return `upstream = "${upstream}"\ntimeout = "10s"\nconnect_timeout = "2s"\n${extra}`;
}

/** A URL nothing listens on. */
export async function deadUrl(): Promise<string> {
  const server = net.createServer();
  server.listen(0, "127.0.0.1");
  await once(server, "listening");
  const port = (server.address() as net.AddressInfo).port;
  server.close();
  await once(server, "close");
  return `http://127.0.0.1:${port}`;
}

// --- the proxy: the worker's network ---------------------------------------------------------

export interface Held {
  readonly path: string;
  /** Resolves true if the worker cut the request while it was held. */
  readonly cut: Promise<boolean>;
  /** Forward it now (if the worker has not cut it); resolves with the gateway's status and rejection reason. */
  forward(): Promise<{ status: number; rejected: string | undefined } | undefined>;
}

/**
 * Between a worker and the gateway: passes everything through, except that
 * with `holdWrites` set a write (`/to/...`) is held on the wire until the test
 * forwards it, and with `failLeases` set the lease API answers 503.
 */
export class Wire {
  holdWrites = false;
  failLeases = false;
  /** Lease calls get no answer at all (until the wire closes). */
  hangLeases = false;
  /** Lease calls that reached the wire. */
  leaseCalls = 0;
  /** Hung lease calls the worker gave up on (closed before an answer). */
  leaseCallsCut = 0;
  readonly #waiters: Array<(held: Held) => void> = [];
  readonly held: Held[] = [];

  private constructor(
    readonly server: http.Server,
    readonly url: string,
    readonly target: string,
  ) {}

  static async start(target: string): Promise<Wire> {
    let proxy: Wire | undefined;
    const server = http.createServer((req, res) => proxy?.handle(req, res));
    server.listen(0, "127.0.0.1");
    await once(server, "listening");
    const port = (server.address() as net.AddressInfo).port;
    proxy = new Wire(server, `http://127.0.0.1:${port}`, target);
    return proxy;
  }

  /** The next held write. */
  nextHeld(): Promise<Held> {
    return new Promise((resolve) => this.#waiters.push(resolve));
  }

  private async handle(req: http.IncomingMessage, res: http.ServerResponse): Promise<void> {
    const chunks: Buffer[] = [];
    for await (const chunk of req) chunks.push(chunk as Buffer);
    const body = Buffer.concat(chunks);
    const url = req.url ?? "/";
    if (url.startsWith("/leases/")) this.leaseCalls++;
    if (this.hangLeases && url.startsWith("/leases/")) {
      res.on("close", () => {
        if (!res.writableFinished) this.leaseCallsCut++;
      });
      return;
    }
    if (this.failLeases && url.startsWith("/leases/")) {
      res.writeHead(503, { "Content-Type": "text/plain", "Retry-After": "2" });
      res.end("lease API down");
      return;
    }
    const pass = (): Promise<{ status: number; rejected: string | undefined }> => this.pass(req, body, res);
    if (!(this.holdWrites && url.startsWith("/to/"))) {
      await pass();
      return;
    }
    let cut = false;
    const closed = new Promise<boolean>((resolve) => {
      res.on("close", () => {
        cut = !res.writableFinished;
        resolve(cut);
      });
    });
    const held: Held = {
      path: url,
      cut: Promise.race([closed, new Promise<boolean>((r) => setTimeout(() => r(cut), 60_000).unref())]),
      forward: async () => (cut ? undefined : pass()),
    };
    this.held.push(held);
    for (const wake of this.#waiters.splice(0)) wake(held);
  }

  private async pass(
    req: http.IncomingMessage,
    body: Buffer,
    res: http.ServerResponse,
  ): Promise<{ status: number; rejected: string | undefined }> {
    const headers = new Headers();
    for (const [name, value] of Object.entries(req.headers)) {
      if (typeof value === "string" && !["host", "connection", "content-length"].includes(name)) {
        headers.set(name, value);
      }
    }
    const init: RequestInit = { method: req.method ?? "GET", headers, redirect: "manual" };
    if (body.length > 0) init.body = body;
    const answer = await fetch(this.target + (req.url ?? "/"), init);
    const payload = Buffer.from(await answer.arrayBuffer());
    const out: Record<string, string> = {};
    answer.headers.forEach((value, name) => {
      if (!["content-length", "content-encoding", "transfer-encoding", "connection"].includes(name)) out[name] = value;
    });
    if (!res.destroyed) {
      res.writeHead(answer.status, out);
      res.end(payload);
    }
    return { status: answer.status, rejected: answer.headers.get("sinkgate-rejected") ?? undefined };
  }

  async close(): Promise<void> {
    this.server.closeAllConnections();
    this.server.close();
  }
}

/** Run Python code with `args` in sys.argv[1:], without blocking this process's
 * servers; resolves with its stdout, rejects on failure. */
export function pythonAsync(code: string, args: string[] = []): Promise<string> {
  return new Promise((resolve, reject) => {
    const child = spawn(PYTHON, ["-c", code, ...args], { stdio: ["ignore", "pipe", "pipe"], env: PYTHON_ENV });
    let out = "";
    let err = "";
    child.stdout.setEncoding("utf8").on("data", (text: string) => {
      out += text;
    });
    child.stderr.setEncoding("utf8").on("data", (text: string) => {
      err += text;
    });
    child.on("error", reject);
    child.on("exit", (code) => (code === 0 ? resolve(out) : reject(new Error(`python failed (${code}): ${err}`))));
  });
}

/** Run Python code with `args` in sys.argv[1:]; returns its stdout (throws on failure).
 * It blocks this process: only for code that calls none of the test's servers. */
export function python(code: string, args: string[] = [], input?: string): string {
  const run = spawnSync(PYTHON, ["-c", code, ...args], {
    encoding: "utf8",
    input,
    maxBuffer: 64 * 1024 * 1024,
    env: PYTHON_ENV,
  });
  if (run.status !== 0) throw new Error(`python failed (${run.status}): ${run.stderr}`);
  return run.stdout;
}
