"""Run inside the training libraries (tests/trainlib.py): one task, given as JSON in argv[1]; prints one JSON line.
Only the libraries' own entry points are called; what they return is saved with torch.save for the test."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import torch


def specforge_rows(task):
    """SpecForge's prompt builder on a JSONL file: conversations (rendered with `template`) or pre-tokenized."""
    from specforge.data.prompt_builder import prepare_prompt_tasks
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(task["tokenizer"]) if task.get("template") else None
    tasks = prepare_prompt_tasks(Path(task["path"]), tok, chat_template=task.get("template"), max_length=4096,
                                 is_preformatted=False, train_only_last_turn=task.get("train_only_last_turn", False),
                                 cache_dir=None, cache_key=None, num_proc=1)
    return {"rows": [{"input_ids": list(map(int, t["payload"]["input_ids"])),
                      "loss_mask": list(map(int, t["payload"]["loss_mask"]))} for t in tasks]}


def specforge_rows_many(task):
    """specforge_rows on several files at once, in one interpreter."""
    return {"results": [specforge_rows(one) for one in task["tasks"]]}


def speculators_prepare(task):
    """`speculators prepare-data` (the real CLI) on the pre-tokenized JSONL; the prepared rows in saved order."""
    from datasets import load_from_disk

    cmd = [sys.executable, "-c", "from speculators.__main__ import app; app()", "prepare-data", "--model",
           task["tokenizer"], "--data", task["path"], "--output", task["out"],
           "--seq-length", str(task.get("seq_length", 4096)),
           "--num-preprocessing-workers", "1", "--overwrite"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"prepare-data failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    ds = load_from_disk(task["out"]).with_format(None)
    return {"columns": ds.column_names, "rows": [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}
                                                 for r in ds]}


def specforge_offline(task):
    """OfflineEagle3Dataset (build_offline_eagle3_dataset), its collator, and the 0.2.0 trainer's reader."""
    from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer
    from specforge.data.preprocessing import build_offline_eagle3_dataset
    from specforge.data.utils import DataCollatorWithPadding
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    ds = build_offline_eagle3_dataset(task["path"], max_len=4096)
    items = [ds[i] for i in range(len(ds))]
    files = [str(p) for p in ds.datapaths] if hasattr(ds, "datapaths") else []
    batch = DataCollatorWithPadding()(items)
    refs = OfflineManifestReader(task["path"], run_id="t", strategy="eagle3", ttt_length=7, max_len=4096,
                                 validate_files=True).read()
    store, normalize = LocalFeatureStore(), build_offline_normalizer(4096)
    normalized = []
    for ref in refs:
        raw, handle = store.get(ref)
        normalized.append(normalize(raw))
        store.release(handle)
    batch2 = build_offline_collator()(normalized)
    same = all(torch.equal(batch[k], batch2[k]) for k in ("input_ids", "loss_mask", "hidden_state", "target"))
    torch.save({"items": items, "batch": batch}, task["save"])
    return {"n": len(items), "files": files, "trainer_reader_same_batch": same}


def speculators_hidden(task):
    """check_hidden_states on every hs_i against row i, then ArrowDataset and CollateFn(shift_batch)."""
    from datasets import load_from_disk
    from safetensors.torch import load_file
    from speculators.data_generation.offline import check_hidden_states
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    ds = load_from_disk(task["path"]).with_format("torch")
    checked = 0
    for i in range(len(ds)):
        check_hidden_states(load_file(Path(task["path"]) / "hidden_states" / f"hs_{i}.safetensors"),
                            ds[i]["input_ids"].tolist())
        checked += 1
    arrow = ArrowDataset(max_len=4096, datapath=task["path"], on_missing="raise", train_ratio=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = [arrow[i] for i in range(len(ds))]
    bad = [type(x).__name__ for x in items if not isinstance(x, dict)]
    hidden = int(items[0]["verifier_last_hidden_states"].shape[-1]) if not bad else 0
    batch = CollateFn(max_len=4096, hidden_size=hidden, num_target_layers=3, preprocess=shift_batch)(items) \
        if not bad else {}
    torch.save({"items": items, "batch": batch, "rows": [ds[i]["input_ids"] for i in range(len(ds))]}, task["save"])
    return {"checked": checked, "not_loaded": bad, "warnings": [str(w.message)[:200] for w in caught]}


def specforge_config(task):
    """SpecForge's own config loader on a training YAML (with overrides); the error class when it refuses."""
    from specforge.config.schema import load_config

    try:
        cfg = load_config(task["yaml"], task.get("overrides") or [])
    except Exception as exc:  # the test asserts on the class SpecForge raised
        return {"ok": False, "error": type(exc).__name__, "message": str(exc)[:500]}
    return {"ok": True, "train_only_last_turn": cfg.data.train_only_last_turn, "chat_template": cfg.data.chat_template}


def specforge_configs(task):
    """specforge_config on several {yaml, overrides} at once, in one interpreter."""
    return {"results": [specforge_config(one) for one in task["configs"]]}


def speculators_image_rows(task):
    """speculators' own preprocessing on `speculators` exports of image runs: `load_raw_dataset` on both files,
    then `_preprocess_batch` (multimodal) on each. The image conversations need a render endpoint; here a stand-in
    for vLLM's `/v1/chat/completions/render` on 127.0.0.1 renders what it is sent as bytes (`<|role|>text<|end|>`,
    an image as its URL), records each image URL, and reads each file:// image (as vLLM would); the render
    boundaries and the loss masks are speculators' own."""
    import hashlib
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import unquote, urlparse

    from speculators.data_generation.preprocessing import _preprocess_batch, load_raw_dataset

    seen = []

    def render(messages, generation):
        out = ""
        for m in messages:
            content = m["content"]
            if not isinstance(content, str):
                pieces = []
                for part in content:
                    if part["type"] == "image_url":
                        url = part["image_url"]["url"]
                        data = Path(unquote(urlparse(url).path)).read_bytes() if url.startswith("file://") else b""
                        seen.append({"url": url, "sha256": hashlib.sha256(data).hexdigest() if data else None})
                        pieces.append(f"[{url}]")
                    else:
                        pieces.append(part["text"])
                content = "".join(pieces)
            out += f"<|{m['role']}|>{content}<|end|>"
        return list((out + ("<|assistant|>" if generation else "")).encode())

    class Render(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = json.dumps({"token_ids": render(body["messages"], body["add_generation_prompt"])}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Render)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # a real vLLM server of the target where the task names one (its ids are token ids, not bytes)
    endpoint = task.get("render_endpoint") or f"http://127.0.0.1:{server.server_address[1]}"
    results = []
    for export in task["exports"]:  # one interpreter for all: importing speculators takes seconds
        seen.clear()
        results.append(_speculators_image_export(export, endpoint, seen, load_raw_dataset, _preprocess_batch,
                                                 stand_in="render_endpoint" not in task))
    server.shutdown()
    return {"exports": results}


class _Kept(logging.Handler):
    """The warnings and errors speculators logs (a conversation it could not render is logged and skipped)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage()[:500])


def _speculators_image_export(task, endpoint, seen, load_raw_dataset, _preprocess_batch, stand_in=True):
    kept = _Kept()
    logging.getLogger("speculators").addHandler(kept)
    out = {"log": kept.lines}
    for name in ("rows", "images"):
        ds, _ = load_raw_dataset(task[name])
        batch = _preprocess_batch(ds[:], True, endpoint, 4096)
        rows = [{"input_ids": list(map(int, ids)), "loss_mask": list(map(int, mask))}
                for ids, mask in zip(batch["input_ids"], batch["loss_mask"])]
        if name == "images" and stand_in:  # the stand-in's ids are bytes: what each row trains, as text
            rows = [{"trained": bytes(i for i, m in zip(r["input_ids"], r["loss_mask"]) if m).decode()} for r in rows]
        out[name] = {"columns": ds.column_names, "n_in": len(ds), "rows": rows, "messages": batch.get("messages")}
    return {**out, "image_urls": list(seen)}


CHECKS = {f.__name__: f for f in (specforge_rows, speculators_prepare, specforge_offline, speculators_hidden,
                                  specforge_config, specforge_configs, speculators_image_rows, specforge_rows_many)}

if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    print(json.dumps(CHECKS[job["check"]](job)))
