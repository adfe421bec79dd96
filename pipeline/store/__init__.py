"""The run directory and what is committed to it: storage (POSIX, object stores), atomic parts, the ledger,
the run lock, the Arrow schemas, records and their quality flags, status and progress.
May import prompts and core (not endpoints, its sibling); never Ray or HTTP."""
