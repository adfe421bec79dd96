"""Hidden states of `regen capture`: the capture layout, its routes (a transformers model in process, or a vLLM
capture server), the hidden parts on disk, bf16 conversion and the free-space check. May import endpoints, store,
prompts and core."""
