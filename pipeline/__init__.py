"""regen: regenerate speculative-decoding training corpora through a fleet of SGLang servers."""

__version__ = "0.1.0"
