"""The shared vocabulary, the bottom layer: the validated run config, the run identity (identity.py:
what a resume compares, the fingerprint, run.json of older code), the error taxonomy,
the units of work, the output-URI check. Imports nothing else of regen, and never Ray or HTTP."""
