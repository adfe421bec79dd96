"""A tiny Kimi-K2.5 (random weights) as a Hugging Face folder, for vLLM's CPU build: the tests' vision-language
model. `make vlm` runs it.

    python -m pipeline.tools.make_tiny_vlm [--out DIR]

Nothing comes from a hub: the config, the tokenizer and the weights are written here, deterministically (a fixed
seed, no timestamps: the same DIR byte for byte on every machine). What vLLM 0.32 reads of it:

- config.json, shaped like moonshotai/Kimi-K2.5's (`model_type: kimi_k25`, `KimiK25ForConditionalGeneration`,
  `use_unified_vision_chunk`, a `kimi_k2` text config with MLA and MoE, a MoonViT vision config), with tiny sizes.
  vLLM reads it through transformers' own Kimi_K25Config, whose vision keys are `hidden_size`,
  `num_hidden_layers`, ... (it ignores the hub's `vt_*` names, so both are written, with the same values). The
  CPU MLA kernel only runs a latent of kv_lora_rank 512 + qk_rope_head_dim 64: those two keep Kimi's sizes.
- model.safetensors under the checkpoint's own names (language_model.model.layers.N..., vision_tower.encoder.
  blocks.N.wqkv, mm_projector.proj.0, ...), float32 (bf16 has no fast matmul on AVX2).
- preprocessor_config.json: Kimi-K2.5's `media_proc_cfg` unchanged (patch 14, merge 2, in_patch_limit 16384,
  512 patches a side), so an image expands to as many `<|media_pad|>` tokens as for the real model. vLLM's own
  fused CPU processor reads it (numba, no torchvision).
- tokenizer.json (transformers maps kimi_k25 to TokenizersBackend: no remote code): byte-level, one token a byte
  (ids 0-255), filler tokens `[unused N]` up to 163583 so that the vocabulary is dense, and Kimi's 256 special
  tokens at Kimi's ids (163584 [BOS] ... 163605 <|media_pad|> ... 163839 [PAD]). Not Kimi's BPE: a prompt's
  text ids differ from the real model's, its special and image ids do not.
- chat_template.jinja: Kimi-like, the emulator's rendering (pipeline/emulator/model.py render_chat) plus image
  parts as `<|media_begin|>image<|media_content|><|media_pad|><|media_end|>` (vLLM's placeholder for Kimi-K2.5).

Needs numpy, safetensors and tokenizers (the project venv). Does nothing when DIR/.complete exists; writes into a
temporary folder beside DIR and renames it into place.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

SEED = 20260125
DEFAULT_OUT = Path.home() / ".cache/regen/models/tiny-kimi-k25"
VOCAB_SIZE = 163840
N_BASE = 163584  # Kimi's plain tokens; the top 256 ids are special tokens
FILLER = "[unused{}]"

# Kimi's special tokens (its tokenizer_config.json); the other ids of the top 256 are <|reserved_token_N|>.
SPECIAL = {
    163584: "[BOS]", 163585: "[EOS]", 163586: "<|im_end|>", 163587: "<|im_user|>", 163588: "<|im_assistant|>",
    163590: "<|start_header_id|>", 163591: "<|end_header_id|>", 163593: "[EOT]", 163594: "<|im_system|>",
    163595: "<|tool_calls_section_begin|>", 163596: "<|tool_calls_section_end|>", 163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>", 163599: "<|tool_call_end|>", 163601: "<|im_middle|>",
    163602: "<|media_begin|>", 163603: "<|media_content|>", 163604: "<|media_end|>", 163605: "<|media_pad|>",
    163606: "<think>", 163607: "</think>", 163838: "[UNK]", 163839: "[PAD]",
}
MEDIA_PAD_ID = 163605
TRANSFORMERS_VERSION = "5.19.0"  # vLLM 0.32.0's venv
BOS_ID, EOS_ID, IM_END_ID, PAD_ID = 163584, 163585, 163586, 163839

TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 512,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32}
VISION = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128,
          "patch_size": 14, "merge_kernel_size": [2, 2], "pos_emb": (64, 64, 4)}

# Kimi-K2.5's preprocessor_config.json media_proc_cfg, unchanged.
MEDIA_PROC_CFG = {
    "in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None, "sample_fps": 2.0,
    "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff",
    "config_type": "media_proc_cfg",
}

# Kimi-like: the emulator's render_chat (no default system prompt; a generation prompt ending with <think>, or
# <think></think> with thinking=false; tools declared in a tool_declare system turn) plus image and video parts.
CHAT_TEMPLATE = """\
{%- macro render_content(msg) -%}
{%- set c = msg.get('content') -%}
{%- if c is string -%}{{ c }}
{%- elif c is not none -%}
{%- for part in c -%}
{%- if part['type'] in ('image', 'image_url') -%}<|media_begin|>image<|media_content|><|media_pad|><|media_end|>
{%- elif part['type'] in ('video', 'video_url') -%}<|kimi_k25_video_placeholder|>
{%- elif part['type'] == 'text' -%}{{ part['text'] }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set role_tokens = {'user': '<|im_user|>', 'assistant': '<|im_assistant|>'} -%}
{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{{ role_tokens.get(message['role'], '<|im_system|>') }}{{ message['role'] }}<|im_middle|>
{%- if message['role'] == 'tool' and message.get('tool_call_id') -%}## Return of {{ message['tool_call_id'] }}
{% endif -%}
{{ render_content(message) }}
{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}<|tool_calls_section_begin|>
{%- for call in message['tool_calls'] -%}<|tool_call_begin|>{{ call.get('id') or '' }}<|tool_call_argument_begin|>
{%- set arguments = call['function']['arguments'] -%}
{%- if arguments is string -%}{{ arguments }}{%- else -%}{{ arguments | tojson }}{%- endif -%}<|tool_call_end|>
{%- endfor -%}<|tool_calls_section_end|>
{%- endif -%}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|><think>
{%- if thinking is defined and thinking is false -%}</think>{%- endif -%}
{%- endif -%}
"""


def config() -> dict:
    t, v = TEXT, VISION
    text_config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": VOCAB_SIZE, **t,
        "hidden_act": "silu", "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.827, "seq_aux": True, "aux_loss_alpha": 0.001,
        "ep_size": 1, "num_nextn_predict_layers": 0, "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "tie_word_embeddings": False, "use_cache": True, "dtype": "float32",
    }
    height, width, frames = v["pos_emb"]
    vision_config = {
        # transformers' Kimi_K25VisionConfig names (what vLLM 0.32 reads) ...
        "hidden_size": v["hidden_size"], "num_hidden_layers": v["num_hidden_layers"],
        "num_attention_heads": v["num_attention_heads"], "intermediate_size": v["intermediate_size"],
        "hidden_act": "gelu_pytorch_tanh", "pos_emb_height": height, "pos_emb_width": width, "pos_emb_time": frames,
        # ... and the hub's, as Kimi-K2.5's config.json has them
        "init_pos_emb_height": height, "init_pos_emb_width": width, "init_pos_emb_time": frames,
        "merge_kernel_size": v["merge_kernel_size"], "merge_type": "sd2_tpool", "mm_hidden_size": v["hidden_size"],
        "mm_projector_type": "patchmerger", "patch_size": v["patch_size"], "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5, "text_hidden_size": t["hidden_size"],
        "video_attn_type": "spatial_temporal", "vt_hidden_size": v["hidden_size"],
        "vt_intermediate_size": v["intermediate_size"], "vt_num_attention_heads": v["num_attention_heads"],
        "vt_num_hidden_layers": v["num_hidden_layers"],
    }
    return {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "ignore_index": -100,
        "media_placeholder_token_id": MEDIA_PAD_ID, "image_token_id": MEDIA_PAD_ID,
        "vision_start_token_id": 163602, "vision_end_token_id": 163604,
        "projection_hidden_size": v["hidden_size"], "projection_layer_norm_eps": 1e-5,
        "use_unified_vision_chunk": True, "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "tie_word_embeddings": False, "dtype": "float32",
        # transformers 5 warns of a "Mistral regex" in any local tokenizer whose config.json has no version
        "transformers_version": TRANSFORMERS_VERSION,
        "text_config": text_config, "vision_config": vision_config,
    }


def weights() -> dict:
    """The checkpoint's tensors under Kimi-K2.5's own names: N(0, 0.02) matrices, unit norms, zero biases."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    out: dict = {}

    def normal(name: str, *shape: int) -> None:
        out[name] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))

    def ones(name: str, n: int) -> None:
        out[name] = np.ones(n, dtype=np.float32)

    def zeros(name: str, n: int) -> None:
        out[name] = np.zeros(n, dtype=np.float32)

    t, v = TEXT, VISION
    h, heads = t["hidden_size"], t["num_attention_heads"]
    lm = "language_model.model."
    normal(lm + "embed_tokens.weight", VOCAB_SIZE, h)
    for i in range(t["num_hidden_layers"]):
        p = f"{lm}layers.{i}."
        ones(p + "input_layernorm.weight", h)
        ones(p + "post_attention_layernorm.weight", h)
        normal(p + "self_attn.q_a_proj.weight", t["q_lora_rank"], h)
        ones(p + "self_attn.q_a_layernorm.weight", t["q_lora_rank"])
        normal(p + "self_attn.q_b_proj.weight", heads * (t["qk_nope_head_dim"] + t["qk_rope_head_dim"]),
               t["q_lora_rank"])
        normal(p + "self_attn.kv_a_proj_with_mqa.weight", t["kv_lora_rank"] + t["qk_rope_head_dim"], h)
        ones(p + "self_attn.kv_a_layernorm.weight", t["kv_lora_rank"])
        normal(p + "self_attn.kv_b_proj.weight", heads * (t["qk_nope_head_dim"] + t["v_head_dim"]),
               t["kv_lora_rank"])
        normal(p + "self_attn.o_proj.weight", h, heads * t["v_head_dim"])
        if i < t["first_k_dense_replace"]:
            for proj, shape in (("gate_proj", (t["intermediate_size"], h)), ("up_proj", (t["intermediate_size"], h)),
                                ("down_proj", (h, t["intermediate_size"]))):
                normal(f"{p}mlp.{proj}.weight", *shape)
            continue
        m = t["moe_intermediate_size"]
        normal(p + "mlp.gate.weight", t["n_routed_experts"], h)
        zeros(p + "mlp.gate.e_score_correction_bias", t["n_routed_experts"])
        for e in range(t["n_routed_experts"]):
            for proj, shape in (("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m))):
                normal(f"{p}mlp.experts.{e}.{proj}.weight", *shape)
        shared = m * t["n_shared_experts"]
        for proj, shape in (("gate_proj", (shared, h)), ("up_proj", (shared, h)), ("down_proj", (h, shared))):
            normal(f"{p}mlp.shared_experts.{proj}.weight", *shape)
    ones(lm + "norm.weight", h)
    normal("language_model.lm_head.weight", VOCAB_SIZE, h)

    vh, vi, patch = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    height, width, _ = v["pos_emb"]
    normal("vision_tower.patch_embed.proj.weight", vh, 3, patch, patch)
    zeros("vision_tower.patch_embed.proj.bias", vh)
    out["vision_tower.patch_embed.pos_emb.weight"] = rng.standard_normal((height, width, vh), dtype=np.float32)
    for i in range(v["num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{i}."
        for norm in ("norm0", "norm1"):
            ones(p + norm + ".weight", vh)
            zeros(p + norm + ".bias", vh)
        normal(p + "wqkv.weight", 3 * vh, vh)
        zeros(p + "wqkv.bias", 3 * vh)
        normal(p + "wo.weight", vh, vh)
        zeros(p + "wo.bias", vh)
        normal(p + "mlp.fc0.weight", vi, vh)
        zeros(p + "mlp.fc0.bias", vi)
        normal(p + "mlp.fc1.weight", vh, vi)
        zeros(p + "mlp.fc1.bias", vh)
    ones("vision_tower.encoder.final_layernorm.weight", vh)
    zeros("vision_tower.encoder.final_layernorm.bias", vh)
    merged = vh * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]
    ones("mm_projector.pre_norm.weight", vh)
    zeros("mm_projector.pre_norm.bias", vh)
    normal("mm_projector.proj.0.weight", merged, merged)
    zeros("mm_projector.proj.0.bias", merged)
    normal("mm_projector.proj.2.weight", t["hidden_size"], merged)
    zeros("mm_projector.proj.2.bias", t["hidden_size"])
    return out


def special_tokens() -> dict[int, str]:
    return {i: SPECIAL.get(i, f"<|reserved_token_{i - N_BASE}|>") for i in range(N_BASE, VOCAB_SIZE)}


def tokenizer_json() -> str:
    """Byte-level: ids 0-255 are the bytes (GPT-2's byte-to-character alphabet), no merges; fillers to N_BASE."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=_byte_of)
    assert len(byte_chars) == 256
    vocab = {char: i for i, char in enumerate(byte_chars)}
    vocab.update({FILLER.format(i): i for i in range(256, N_BASE)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    # cl100k's split (Kimi's own adds Han-script rules); then bytes to ByteLevel's alphabet
    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    specials = special_tokens()
    tokenizer.add_special_tokens([AddedToken(specials[i], special=True, normalized=False)
                                  for i in range(N_BASE, VOCAB_SIZE)])
    for i, token in specials.items():
        if tokenizer.token_to_id(token) != i:
            raise SystemExit(f"make_tiny_vlm: {token} got id {tokenizer.token_to_id(token)}, not {i}")
    return tokenizer.to_str()


def _byte_of(char: str) -> int:
    """The byte GPT-2's byte-to-unicode map sends to `char`."""
    code = ord(char)
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if code in printable:
        return code
    return sorted(set(range(256)) - set(printable))[code - 256]


def tokenizer_config() -> dict:
    specials = special_tokens()
    return {
        "tokenizer_class": "TokenizersBackend", "model_max_length": 262144, "clean_up_tokenization_spaces": False,
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "added_tokens_decoder": {str(i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for i, token in specials.items()},
    }


def write(folder: Path) -> None:
    from safetensors.numpy import save_file

    def dump(name: str, data: dict) -> None:
        (folder / name).write_text(json.dumps(data, indent=2) + "\n")

    dump("config.json", config())
    # the answer ends at <|im_end|> (Kimi's generation_config), [EOS] ends a document
    dump("generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": IM_END_ID, "pad_token_id": PAD_ID})
    dump("preprocessor_config.json", {"media_proc_cfg": MEDIA_PROC_CFG})
    dump("tokenizer_config.json", tokenizer_config())
    (folder / "tokenizer.json").write_text(tokenizer_json())
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    save_file(weights(), str(folder / "model.safetensors"), metadata={"format": "pt"})


def make(out: Path) -> bool:
    """Write the model into `out`; False when it is already complete."""
    if (out / ".complete").exists():
        return False
    started = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        write(staging)
        staging.chmod(0o755)  # mkdtemp makes it 0700
        digest = hashlib.sha256()
        for path in sorted(staging.iterdir()):
            path.chmod(0o644)
            digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
        (staging / ".complete").write_text(json.dumps(
            {"seed": SEED, "sha256": digest.hexdigest(), "seconds": round(time.monotonic() - started, 1)}))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.tools.make_tiny_vlm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    args = parser.parse_args(argv)
    started = time.monotonic()
    done = make(args.out)
    print(f"{'written' if done else 'already written'}: {args.out} ({time.monotonic() - started:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
