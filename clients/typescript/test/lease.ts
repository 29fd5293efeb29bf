/** Test helpers over the client. */

import { type Lease, type LeaseClient, LeaseHeld } from "@sinkgate/leases";

/** Claim `jobId`, waiting out a lease held by someone else (it has a short ttl). */
export async function claimWhenFree(client: LeaseClient, jobId: string, owner: string, ttl: number): Promise<Lease> {
  for (let tries = 0; ; tries++) {
    try {
      return await client.claim(jobId, { owner, ttl });
    } catch (error) {
      if (!(error instanceof LeaseHeld) || tries > 50) throw error;
      await new Promise((resolve) => setTimeout(resolve, error.expiresIn * 1000 + 20));
    }
  }
}
