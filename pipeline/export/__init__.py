"""Committed runs -> training files: the SpecForge / speculators / TorchSpec JSONL exports and their row builders,
the hidden-state exports, the dataset card. May import hidden, endpoints, store, prompts and core; not dispatch."""
