"""Hidden states: the /generate request that captures them, byte-level parsing (and its C kernel), alignment,
and the hidden parts on disk. May import endpoints, store, prompts and core."""
