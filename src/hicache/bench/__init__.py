"""`hicache bench`: an HTTP benchmark client for OpenAI-compatible servers (no torch, no engine)."""
