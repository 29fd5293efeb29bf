"""Side-by-side benchmark of the gateway against an upstream and a plain proxy (issue 8)."""
