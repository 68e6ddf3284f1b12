"""Stand-in for SGLang (tests only)."""
