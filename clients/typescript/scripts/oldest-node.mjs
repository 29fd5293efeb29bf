// The built tests once more on Node.js 18, the oldest `engines` admits, so a
// newer API (AbortSignal.any, say) cannot slip into the package unseen. The
// binary is the registry's node-<os>-<arch> package, fetched by `npm exec` into
// npm's cache: nothing is added to the project's dependencies. Where the
// registry has no such build, this skips with the reason, except under
// CI=true, where it fails.
import { spawnSync } from "node:child_process";
import { readdirSync } from "node:fs";

const OLDEST = "18.20.8"; // the last release of Node.js 18
const OS = { linux: "linux", darwin: "darwin" }[process.platform];
const ARCH = { x64: "x64", arm64: "arm64" }[process.arch];
const CI = /^(true|1)$/i.test((process.env.CI ?? "").trim());
const NPM = process.platform === "win32" ? "npm.cmd" : "npm";

function giveUp(reason) {
  if (CI) {
    console.error(`${reason} (CI=true: the tests on Node.js ${OLDEST} must run)`);
    process.exit(1);
  }
  console.log(`skipped the tests on Node.js ${OLDEST}: ${reason}`);
  process.exit(0);
}

function onOldest(args, options = {}) {
  const pkg = `--package=node-${OS}-${ARCH}@${OLDEST}`;
  return spawnSync(NPM, ["exec", "--yes", pkg, "--", "node", ...args], options);
}

if (OS === undefined || ARCH === undefined) {
  giveUp(`the registry has no Node.js build for ${process.platform}-${process.arch}`);
}
const version = onOldest(["--version"], { encoding: "utf8" });
if (version.status !== 0) {
  giveUp(`npm exec could not fetch or run it: ${(version.stderr ?? "").trim()}`);
}
if (version.stdout.trim() !== `v${OLDEST}`) {
  console.error(`expected Node.js v${OLDEST}, npm exec ran ${version.stdout.trim()}`);
  process.exit(1);
}
const tests = readdirSync("build-test/test")
  .filter((name) => name.endsWith(".test.js"))
  .map((name) => `build-test/test/${name}`);
console.log(`the tests again on Node.js ${OLDEST}`);
const run = onOldest(["--test", "--test-reporter=spec", ...tests], { stdio: "inherit" });
process.exit(run.status ?? 1);
