"""regen: regenerate speculative-decoding training corpora through a fleet of SGLang servers."""

import time as _time

__version__ = "0.1.0"
IMPORTED_AT = _time.monotonic()  # about when the process started: the run's log times its start from here
