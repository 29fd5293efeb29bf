/** The reason table and the writer's error families are the Python side's. */

import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { BadWrite, LOST_REASONS, REASONS, rejectionFromResponse } from "@sinkgate/leases";
import { gatewayMissing, missing, python } from "./harness.js";

const skip = missing(gatewayMissing());

describe("against the Python table", { skip }, () => {
  const theirs = JSON.parse(
    python(`
import json
from leases.reasons import REASONS, LOST_REASONS
from leases.rejections import _FAMILY
print(json.dumps({
    "reasons": {str(r): [i.status, str(i.family), i.recorded, i.retry_later] for r, i in REASONS.items()},
    "lost": [str(r) for r in LOST_REASONS],
    "families": {str(r): f.__name__ for r, f in _FAMILY.items()},
}))`),
  ) as { reasons: Record<string, unknown[]>; lost: string[]; families: Record<string, string> };

  it("has the same reasons, statuses, families and flags, in the same order", () => {
    const ours = Object.fromEntries(
      Object.entries(REASONS).map(([r, i]) => [r, [i.status, i.family, i.recorded, i.retryLater]]),
    );
    assert.deepEqual(ours, theirs.reasons);
    assert.deepEqual(Object.keys(REASONS), Object.keys(theirs.reasons));
    assert.deepEqual(LOST_REASONS, theirs.lost);
  });

  it("raises the same error family for every reason", () => {
    for (const reason of Object.keys(REASONS)) {
      const error = rejectionFromResponse(
        REASONS[reason]?.status ?? 400,
        new Headers({ "Sinkgate-Rejected": reason }),
        new Uint8Array(),
      );
      // Reasons outside the Python map are classified by status there too.
      const expected =
        theirs.families[reason] ?? ((REASONS[reason]?.status ?? 0) >= 500 ? "GatewayUnavailable" : "BadWrite");
      assert.equal(error.constructor.name, expected, reason);
    }
    const unknown = rejectionFromResponse(418, new Headers({ "Sinkgate-Rejected": "newer_reason" }), new Uint8Array());
    assert.ok(unknown instanceof BadWrite);
  });
});
