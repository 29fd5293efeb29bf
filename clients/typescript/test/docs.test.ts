/** The TypeScript in docs/workers-typescript.md and README.md type-checks against the package. */

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import path from "node:path";
import { describe, it } from "node:test";
import { fileURLToPath } from "node:url";

const PACKAGE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..");
const DOCS = [path.join(PACKAGE, "..", "..", "docs", "workers-typescript.md"), path.join(PACKAGE, "README.md")];

describe("the documentation's examples", () => {
  it("type-check under the package's strict settings", () => {
    // Inside the package, so `@sinkgate/leases` resolves to it and bullmq to its dev copy.
    const dir = mkdtempSync(path.join(PACKAGE, ".docs-check-"));
    try {
      const files: string[] = [];
      let blocks = 0;
      for (const doc of DOCS) {
        for (const match of readFileSync(doc, "utf8").matchAll(/```ts\n([\s\S]*?)```/g)) {
          blocks += 1;
          // each block is a module of its own; top-level await needs one
          files.push(`block${blocks}.ts`);
          writeFileSync(path.join(dir, `block${blocks}.ts`), `${match[1]}\nexport {};\n`);
        }
      }
      assert.ok(blocks >= 3, `found ${blocks} blocks`);
      writeFileSync(
        path.join(dir, "tsconfig.json"),
        JSON.stringify({
          extends: "../tsconfig.json",
          compilerOptions: { noEmit: true, rootDir: ".", noUnusedLocals: false, noUnusedParameters: false },
          files,
          include: [],
        }),
      );
      const tsc = path.join(PACKAGE, "node_modules", "typescript", "bin", "tsc");
      const run = spawnSync(process.execPath, [tsc, "-p", dir], { encoding: "utf8" });
      assert.equal(run.status, 0, run.stdout + run.stderr);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
