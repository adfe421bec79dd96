"""The shared vocabulary, the bottom layer: the validated run config and its fingerprint, the error taxonomy,
the units of work, the output-URI check. Imports nothing else of regen, and never Ray or HTTP."""
