"""Ray dispatch: the driver's dispatcher, one async endpoint worker per endpoint (actors.py places them), routing,
requeue, and the transport between them (Ray actors, or the same workers in-process); and `regen capture`'s pool of
capture actors (capture_pool.py, capture_worker.py). May import hidden, endpoints, store, prompts and core (not
export, its sibling); only run.py and capture.py commit."""
