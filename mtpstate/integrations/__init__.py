"""Adapters for serving engines (import no engine at import time)."""
