"""User commands around a run, not the run itself: `regen simulate` (a time-compressed dry run against
emulated endpoints) and `regen bench-endpoints`. May import run, every stage and the emulator."""
