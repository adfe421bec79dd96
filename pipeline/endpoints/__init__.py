"""The servers: the HTTP client and its one error classifier, per-engine probes, the fleet preflight and its
table, the local fleet (llama.cpp or vLLM). May import prompts and core (it needs only core); not store, its sibling."""
