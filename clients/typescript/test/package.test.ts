/** The package's own targets: no runtime dependencies, under 100 kB unpacked, both exports built. */

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { describe, it } from "node:test";
import { fileURLToPath } from "node:url";

const PACKAGE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..");

describe("the package", () => {
  const manifest = JSON.parse(readFileSync(path.join(PACKAGE, "package.json"), "utf8")) as Record<string, unknown>;

  it("is under the Python package's licence, and runs no script where it is installed", () => {
    const pyproject = readFileSync(path.join(PACKAGE, "..", "..", "pyproject.toml"), "utf8");
    assert.match(pyproject, new RegExp(`^license = \\{ text = "${manifest.license as string}" \\}$`, "m"));
    const scripts = Object.keys(manifest.scripts as object);
    for (const hook of ["preinstall", "install", "postinstall", "prepare"]) {
      assert.ok(!scripts.includes(hook), `no ${hook} script`);
    }
  });

  it("has no runtime dependencies, and bullmq only as an optional peer", () => {
    assert.equal(manifest.dependencies, undefined);
    assert.deepEqual(Object.keys(manifest.peerDependencies as object), ["bullmq"]);
    assert.deepEqual(manifest.peerDependenciesMeta, { bullmq: { optional: true } });
  });

  // A guard against shipping tests, maps or sources by mistake: the code (comments kept,
  // for the readers of node_modules and the JSDoc of the types) and the licence were 121 kB.
  it("packs under 130 kB unpacked (the licence text is 11 kB of it), with both exports and their types", () => {
    const npm = process.platform === "win32" ? "npm.cmd" : "npm";
    const run = spawnSync(npm, ["pack", "--dry-run", "--json", "--ignore-scripts"], { cwd: PACKAGE, encoding: "utf8" });
    assert.equal(run.status, 0, run.stderr);
    const [packed] = JSON.parse(run.stdout) as Array<{ unpackedSize: number; files: Array<{ path: string }> }>;
    assert.ok(packed !== undefined);
    assert.ok(packed.unpackedSize < 130_000, `unpacked size ${packed.unpackedSize} bytes`);
    const files = packed.files.map((file) => file.path);
    for (const file of ["dist/index.js", "dist/index.d.ts", "dist/bullmq.js", "dist/bullmq.d.ts", "LICENSE"]) {
      assert.ok(files.includes(file), `${file} is packed`);
    }
  });

  it("installs from `npm pack`'s file into an empty project, where it loads and its bullmq entry names the missing peer", () => {
    const npm = process.platform === "win32" ? "npm.cmd" : "npm";
    const project = mkdtempSync(path.join(tmpdir(), "sinkgate-consumer-"));
    try {
      // as docs/workers-typescript.md says: pack in the checkout, install the file
      // (dist/ is pretest's: prepack's rebuild would rewrite it under other tests)
      const pack = spawnSync(npm, ["pack", "--json", "--ignore-scripts", "--pack-destination", project], {
        cwd: PACKAGE,
        encoding: "utf8",
      });
      assert.equal(pack.status, 0, pack.stderr);
      const [packed] = JSON.parse(pack.stdout.slice(pack.stdout.indexOf("["))) as Array<{ filename: string }>;
      assert.ok(packed !== undefined);
      writeFileSync(
        path.join(project, "package.json"),
        JSON.stringify({ name: "consumer", private: true, type: "module" }),
      );
      const quiet = ["--no-audit", "--no-fund", "--ignore-scripts", "--loglevel=error"];
      const install = spawnSync(npm, ["install", ...quiet, `./${packed.filename}`], { cwd: project, encoding: "utf8" });
      assert.equal(install.status, 0, install.stderr);
      const script = [
        'import { deriveKey, LeaseClient } from "@sinkgate/leases";',
        'const bullmq = await import("@sinkgate/leases/bullmq").catch((error) => error.code);',
        'console.log(JSON.stringify([deriveKey("order-1001", "charge"), typeof LeaseClient, bullmq]));',
      ].join("\n");
      const run = spawnSync(process.execPath, ["--input-type=module", "-e", script], {
        cwd: project,
        encoding: "utf8",
      });
      assert.equal(run.status, 0, run.stderr);
      // the bullmq entry needs the optional peer, which this project lacks: it names what is missing
      assert.deepEqual(JSON.parse(run.stdout), [
        "order-1001:charge:389c69014bfe71e29167028a14efa2b2",
        "function",
        "ERR_MODULE_NOT_FOUND",
      ]);
    } finally {
      rmSync(project, { recursive: true, force: true });
    }
  });
});
