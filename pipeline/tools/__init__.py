"""User commands around a run, not the run itself: `regen simulate` (a time-compressed dry run of the real
pipeline against emulated endpoints) and `regen bench-endpoints`. May import run.py, every stage and the emulator."""
