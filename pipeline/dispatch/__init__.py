"""Ray dispatch: the driver's dispatcher, one async endpoint worker per endpoint, routing and requeue.
May import hidden, endpoints, store, prompts and core (not export, its sibling); only run.py commits."""
