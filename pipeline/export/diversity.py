"""How diverse the samples of a run with `samples_per_prompt: k > 1` are, for the dataset card (card.py).

Measured on a deterministic subset of the prompts (at most MAX_PROMPTS, and at most MAX_SAMPLES samples in all, so
a large k takes fewer prompts: those of lowest blake2b hash of their id, so the same run gives the same subset),
never the whole run in memory: one pass over the id columns keeps the subset's ids, a second reads the subset's
completions (their tokens only). For each prompt whose k samples are all committed:

- distinct completions: how many of its k samples differ (by token ids);
- the mean pairwise Jaccard overlap of the samples' token 4-gram sets (1: the same 4-grams, 0: none shared), over
  the pairs of its first MAX_PAIRED samples (k (k - 1) / 2 pairs would not end for a large k).

A sample's completion is its first generation (all_turns: turn 0; later turns follow different histories). Its
tokens are its `output_token_ids`; a record without them (e.g. llama.cpp) is split into whitespace words of its
content and reasoning, and the card says how many were.
"""
from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from ..store.rundir import RunDir

MAX_PROMPTS = 2000
MAX_SAMPLES = 8000  # the samples' tokens held at once: 2000 prompts up to k = 4, fewer prompts past it
MAX_PAIRED = 16  # the samples of a prompt whose pairs are compared (120 pairs at most)
NGRAM = 4


@dataclass(frozen=True)
class Diversity:
    samples_per_prompt: int
    prompts_measured: int  # prompts of the subset with all k samples committed
    subset: int  # prompts in the subset (at most MAX_PROMPTS)
    prompts_committed: int  # distinct prompts with a committed record
    distinct_mean: float
    distinct_min: int
    jaccard_mean: float | None  # None: no prompt had two samples with a 4-gram each
    word_tokens: int  # samples measured by whitespace words (no token ids)
    paired: int = 0  # the samples of each prompt whose pairs the Jaccard overlap compares (its first ones)


def _rank(prompt_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(prompt_id.encode(), digest_size=8).digest(), "big")


def _subset(run_dir: RunDir, size: int) -> set[str]:
    """The `size` committed prompts of lowest hash (a prompt left out once is never taken later: the bar only
    falls), holding `size` ids at most."""
    heap: list[tuple[int, str]] = []  # (-rank, id): the kept ids, worst on top
    kept: set[str] = set()
    for part in RunDir.parts(run_dir.data):
        for pid in set(part.read_parquet(columns=["prompt_id"]).column(0).to_pylist()):
            if pid in kept:
                continue
            rank = _rank(pid)
            if len(heap) < size:
                heapq.heappush(heap, (-rank, pid))
                kept.add(pid)
            elif -heap[0][0] > rank:
                _, out = heapq.heapreplace(heap, (-rank, pid))
                kept.discard(out)
                kept.add(pid)
    return kept


def _ngrams(tokens: tuple) -> set[tuple]:
    return {tokens[i:i + NGRAM] for i in range(len(tokens) - NGRAM + 1)}


def jaccard(a: set, b: set) -> float:
    union = len(a | b)
    return len(a & b) / union if union else 1.0


def _tokens(row: dict[str, Any]) -> tuple[tuple, bool]:
    """(the sample's tokens, whether they are whitespace words). An empty completion has its (empty) token ids."""
    if row.get("output_token_ids") is not None:
        return tuple(row["output_token_ids"]), False
    text = " ".join(t for t in (row.get("reasoning_content"), row.get("content"), row.get("tool_calls")) if t)
    return tuple(text.split()), True


def sample_diversity(run_dir: RunDir, k: int, committed: int, max_prompts: int = MAX_PROMPTS,
                     max_samples: int = MAX_SAMPLES) -> Diversity | None:
    """None for a run of one sample, or one with no committed record. `committed`: distinct prompts committed."""
    if k <= 1:
        return None
    subset = _subset(run_dir, max(1, min(max_prompts, max_samples // k)))
    if not subset:
        return None
    # (prompt, sample) -> its lowest turn, that turn's tokens and whether they are words
    first: dict[tuple[str, int], tuple[int, tuple, bool]] = {}
    columns = ["prompt_id", "sample_index", "turn_index", "output_token_ids", "content", "reasoning_content",
               "tool_calls"]
    for part in RunDir.parts(run_dir.data):
        present = set(part.parquet_schema().names)
        for row in part.read_parquet(columns=[c for c in columns if c in present]).to_pylist():
            if row["prompt_id"] not in subset:
                continue
            key, turn = (row["prompt_id"], row.get("sample_index") or 0), row.get("turn_index") or 0
            if key not in first or turn < first[key][0]:
                first[key] = (turn, *_tokens(row))
    by_prompt: dict[str, dict[int, tuple[tuple, bool]]] = {}
    for (pid, j), (_, t, by_words) in first.items():
        if j < k:
            by_prompt.setdefault(pid, {})[j] = (t, by_words)
    distinct, overlaps, words = [], [], 0
    for samples in by_prompt.values():
        if len(samples) < k:
            continue  # not all of its samples are committed yet
        tokens = [samples[j][0] for j in range(k)]
        words += sum(samples[j][1] for j in range(k))
        distinct.append(len(set(tokens)))
        grams = [_ngrams(t) for t in tokens[:MAX_PAIRED]]
        pairs = [jaccard(a, b) for a, b in combinations(grams, 2) if a or b]
        if pairs:
            overlaps.append(sum(pairs) / len(pairs))
    if not distinct:
        return Diversity(k, 0, len(subset), committed, 0.0, 0, None, words, min(k, MAX_PAIRED))
    return Diversity(k, len(distinct), len(subset), committed, sum(distinct) / len(distinct), min(distinct),
                     sum(overlaps) / len(overlaps) if overlaps else None, words, min(k, MAX_PAIRED))


def diversity_lines(d: Diversity | None) -> list[str]:
    """The card's "Samples" section (nothing for a run of one sample)."""
    if d is None:
        return []
    lines = ["## Samples", "",
             f"{d.samples_per_prompt} samples of each prompt (`samples_per_prompt`), each drawn with a seed of its "
             "own. Measured on "
             + (f"all {d.subset} committed prompts" if d.subset == d.prompts_committed else
                f"a deterministic subset of {d.subset} of the {d.prompts_committed} committed prompts (those of "
                "lowest blake2b hash of their id)")
             + f"; {d.prompts_measured} of them have all {d.samples_per_prompt} samples committed and are counted. "
             "Each sample's first generation (all_turns: turn 0) is compared"
             + ("." if d.paired >= d.samples_per_prompt else
                f"; the Jaccard overlap over the pairs of each prompt's first {d.paired} samples."), ""]
    if not d.prompts_measured:
        return lines + ["No prompt has all its samples committed yet.", ""]
    jaccard_text = "-" if d.jaccard_mean is None else f"{d.jaccard_mean:.3f}"
    lines += ["| figure | value |", "|---|---:|",
              f"| distinct completions per prompt (mean, of {d.samples_per_prompt}) | {d.distinct_mean:.2f} |",
              f"| distinct completions per prompt (min) | {d.distinct_min} |",
              f"| mean pairwise Jaccard overlap of token {NGRAM}-grams | {jaccard_text} |", "",
              "A Jaccard overlap near 1 means the samples repeat each other (little to gain from k > 1); near 0, "
              "they share few 4-grams."]
    if d.word_tokens:
        lines.append(f"{d.word_tokens} samples had no token ids: their whitespace-separated words were compared.")
    return lines + [""]
