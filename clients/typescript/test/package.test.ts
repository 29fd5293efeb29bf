/** The package's own targets: no runtime dependencies, under 100 kB unpacked, both exports built. */

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import path from "node:path";
import { describe, it } from "node:test";
import { fileURLToPath } from "node:url";

const PACKAGE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..");

describe("the package", () => {
  const manifest = JSON.parse(readFileSync(path.join(PACKAGE, "package.json"), "utf8")) as Record<string, unknown>;

  it("has no runtime dependencies, and bullmq only as an optional peer", () => {
    assert.equal(manifest.dependencies, undefined);
    assert.deepEqual(Object.keys(manifest.peerDependencies as object), ["bullmq"]);
    assert.deepEqual(manifest.peerDependenciesMeta, { bullmq: { optional: true } });
  });

  it("packs under 100 kB unpacked, with both exports and their types", () => {
    const npm = process.platform === "win32" ? "npm.cmd" : "npm";
    const run = spawnSync(npm, ["pack", "--dry-run", "--json", "--ignore-scripts"], { cwd: PACKAGE, encoding: "utf8" });
    assert.equal(run.status, 0, run.stderr);
    const [packed] = JSON.parse(run.stdout) as Array<{ unpackedSize: number; files: Array<{ path: string }> }>;
    assert.ok(packed !== undefined);
    assert.ok(packed.unpackedSize < 100_000, `unpacked size ${packed.unpackedSize} bytes`);
    const files = packed.files.map((file) => file.path);
    for (const file of ["dist/index.js", "dist/index.d.ts", "dist/bullmq.js", "dist/bullmq.d.ts"]) {
      assert.ok(files.includes(file), `${file} is packed`);
    }
  });
});
