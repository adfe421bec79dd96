"""Sources -> prompts: readers and format adapters, normalisation and validation with reasons, the
content-addressed prompt_id, per-source limits and dedup, and what is sent for each turn.
May import only core; never Ray or an HTTP client (a hub source is read through `datasets` alone)."""
