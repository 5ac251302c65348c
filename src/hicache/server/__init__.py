"""OpenAI-compatible HTTP server over the engine (imports the engine; never imported by it)."""
