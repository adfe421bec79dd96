"""Ray dispatch: the driver's dispatcher, one async endpoint worker per endpoint (actors.py places them), routing,
requeue, and the transport between them (Ray actors, or the same workers in-process). May import hidden,
endpoints, store, prompts and core (not export, its sibling); only run.py commits."""
