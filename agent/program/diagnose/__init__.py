"""`gpuwarden check` (a one-shot preflight) and `gpuwarden diag` (a redacted support bundle)."""
