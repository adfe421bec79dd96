"""Ray dispatch: the driver's dispatcher, one async endpoint worker per endpoint, routing and requeue.
Imports hidden, endpoints, prompts and core (never store: only the driver commits, in run.py)."""
