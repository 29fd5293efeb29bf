/** deriveKey and the body bytes: byte for byte what the Python worker side gives. */

import assert from "node:assert/strict";
import { randomInt } from "node:crypto";
import { describe, it } from "node:test";
import { canonicalJson, deriveKey } from "@sinkgate/leases";
import { jobIdFrom } from "@sinkgate/leases/bullmq";
import { gatewayMissing, missing, python } from "./harness.js";

describe("deriveKey", () => {
  it("gives SPEC 3.2's four vectors", () => {
    assert.equal(deriveKey("order-1001", "charge"), "order-1001:charge:389c69014bfe71e29167028a14efa2b2");
    assert.equal(deriveKey("order-1001", "refund #2"), "order-1001:refund_#2:236ddc0006852abee334c4c553cc4561");
    assert.equal(deriveKey("job:42", "a:b"), "job:42:a:b:6b277a26cbc727f6cc8cef34c8f8d01f");
    assert.equal(deriveKey("x", "émail ✉ 😀"), "x:mail:eb9286702d520c25389dcf31ddf4aee9");
  });

  it("keeps (a:b, c) and (a, b:c) apart and stays within 255 visible ASCII", () => {
    assert.notEqual(deriveKey("a:b", "c"), deriveKey("a", "b:c"));
    const key = deriveKey("j".repeat(256), "s".repeat(1000));
    assert.ok(key.length <= 255 && /^[\x21-\x7e]+$/.test(key));
    assert.match(deriveKey("x", "✉ ✉"), /^x:step:[0-9a-f]{32}$/);
  });

  it("refuses bad arguments", () => {
    assert.throws(() => deriveKey("", "charge"), RangeError);
    assert.throws(() => deriveKey("has space", "charge"), RangeError);
    assert.throws(() => deriveKey("x", ""), RangeError);
    assert.throws(() => deriveKey(1 as unknown as string, "charge"), TypeError);
    assert.throws(() => deriveKey("x", null as unknown as string), TypeError);
  });
});

describe("canonicalJson", () => {
  it("writes what json.dumps(sort_keys, compact, ensure_ascii) writes", () => {
    assert.equal(
      canonicalJson({ b: 1, a: [1.5, 1e-7, 1e21, "é\u007f"], c: undefined }),
      '{"a":[1.5,1e-07,1e+21,"\\u00e9\\u007f"],"b":1}',
    );
    assert.equal(canonicalJson([undefined, new Date(0)]), '[null,"1970-01-01T00:00:00.000Z"]');
  });

  it("refuses what has no JSON form", () => {
    const loop: Record<string, unknown> = {};
    loop.self = loop;
    assert.throws(() => canonicalJson(loop), TypeError);
    assert.throws(() => canonicalJson(Number.POSITIVE_INFINITY), RangeError);
    assert.throws(() => canonicalJson(undefined), TypeError);
    assert.equal(canonicalJson({ same: [1], again: [1] }), '{"again":[1],"same":[1]}');
  });
});

const ALPHABETS = [
  [0x21, 0x7e], // visible ASCII
  [0x00, 0x20], // controls and space
  [0x7f, 0x7ff], // DEL, Latin-1, two-byte UTF-8
  [0x800, 0xd7ff], // three-byte UTF-8 below the surrogates
  [0xe000, 0xffff], // above them
  [0x10000, 0x10ffff], // astral: surrogate pairs in UTF-16 and json.dumps
] as const;

function randomText(max: number): string {
  let text = "";
  const length = randomInt(1, max + 1);
  for (let i = 0; i < length; i++) {
    const [low, high] = ALPHABETS[randomInt(ALPHABETS.length)] ?? [0x21, 0x7e];
    text += String.fromCodePoint(randomInt(low, high + 1));
  }
  return text;
}

function randomVisible(max: number): string {
  return Array.from({ length: randomInt(1, max + 1) }, () => String.fromCharCode(randomInt(0x21, 0x7f))).join("");
}

function randomValue(depth: number): unknown {
  switch (randomInt(depth > 2 ? 5 : 7)) {
    case 0:
      return randomText(12);
    case 1:
      return randomInt(-1_000_000, 1_000_000);
    case 2:
      return (Math.random() - 0.5) * 10 ** randomInt(-8, 22);
    case 3:
      return [true, false, null][randomInt(3)];
    case 4:
      return Number.MAX_SAFE_INTEGER - randomInt(10);
    case 5:
      return Array.from({ length: randomInt(4) }, () => randomValue(depth + 1));
    default:
      return Object.fromEntries(Array.from({ length: randomInt(5) }, () => [randomText(6), randomValue(depth + 1)]));
  }
}

const skip = missing(gatewayMissing());

describe("against Python", { skip }, () => {
  it("derives the same key for 500 random (job id, step) pairs, non-ASCII and astral included", () => {
    const pairs = Array.from({ length: 500 }, () => [randomVisible(randomInt(2) ? 8 : 300), randomText(40)]);
    const theirs = JSON.parse(
      python(
        "import json, sys\nfrom leases.writer import derive_key\n" +
          "print(json.dumps([derive_key(j, s) for j, s in json.load(sys.stdin)]))",
        [],
        JSON.stringify(pairs.map(([job, step]) => [job?.slice(0, 256), step])),
      ),
    ) as string[];
    pairs.forEach(([job = "", step = ""], i) => {
      assert.equal(
        deriveKey(job.slice(0, 256), step),
        theirs[i],
        `job ${JSON.stringify(job)} step ${JSON.stringify(step)}`,
      );
    });
  });

  it("writes the same JSON body bytes as the Python writer for 300 random payloads", () => {
    const payloads = Array.from({ length: 300 }, () => randomValue(0));
    const theirs = JSON.parse(
      python(
        "import json, sys\n" +
          "print(json.dumps([json.dumps(v, sort_keys=True, separators=(',', ':'), allow_nan=False)" +
          " for v in json.load(sys.stdin)]))",
        [],
        JSON.stringify(payloads),
      ),
    ) as string[];
    payloads.forEach((payload, i) => {
      assert.equal(canonicalJson(payload), theirs[i], JSON.stringify(payload));
    });
  });
});

describe("jobIdFrom against Python's job_id_from", { skip }, () => {
  it("keeps the first 200 code points, not 200 UTF-16 units", () => {
    // Lone surrogates too, hashed as their own bytes on both sides. Python gets the
    // UTF-16 code units, so a pair reaches it as its two halves (JSON would join them).
    const texts = [
      "😀".repeat(150),
      "a😀".repeat(150),
      "job 1",
      "j".repeat(257),
      "",
      "\ud800",
      "a\udc00b",
      "\udbff😀",
      "\ude00\ud83d",
    ];
    for (let i = 0; i < 200; i++) texts.push(randomText(randomInt(2) ? 20 : 300));
    const theirs = JSON.parse(
      python(
        "import json, sys\nfrom leases.integrations.gate import job_id_from\n" +
          "texts = [''.join(map(chr, units)) for units in json.load(sys.stdin)]\n" +
          "print(json.dumps([job_id_from(t) for t in texts]))",
        [],
        JSON.stringify(texts.map((text) => Array.from({ length: text.length }, (_, k) => text.charCodeAt(k)))),
      ),
    ) as string[];
    assert.match(theirs[0] ?? "", /^_{150}:[0-9a-f]{32}$/);
    texts.forEach((text, i) => {
      assert.equal(jobIdFrom(text), theirs[i], JSON.stringify(text));
    });
  });

  it("keeps two ids with different lone surrogates apart", () => {
    // Hashed through Node's UTF-8, both would be U+FFFD: one job id for two jobs.
    assert.notEqual(jobIdFrom("job \ud800"), jobIdFrom("job \udbff"));
    assert.notEqual(jobIdFrom("job \ud800"), jobIdFrom("job \ufffd"));
  });

  it("takes only a string (a number was returned as it came, not as a job id)", () => {
    assert.throws(() => jobIdFrom(42 as unknown as string), TypeError);
  });
});
