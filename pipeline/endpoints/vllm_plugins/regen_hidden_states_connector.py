"""Loaded by a vLLM 0.32.0 server, never by regen (this folder is not a package of regen: it goes on the
server's PYTHONPATH, as vllm_serve.py's arguments do):

    PYTHONPATH=<this folder> python -m vllm.entrypoints.openai.api_server ... \
      --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
                             "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27, 30]}}}' \
      --kv-transfer-config '{"kv_connector": "CpuHiddenStatesConnector",
                             "kv_connector_module_path": "regen_hidden_states_connector", "kv_role": "kv_producer",
                             "kv_connector_extra_config": {"shared_storage_path": "<a folder regen can read>"}}'

vLLM's own ExampleHiddenStatesConnector writes each request's states to a safetensors file and answers with its
path (kv_transfer_params.hidden_states_path), but on the CPU build it dies: its _submit_async_write copies the
states into pinned memory (torch.empty_like(..., pin_memory=True)), which CPU torch refuses, so the EngineCore
and then the whole server exit after the first answer. This subclass changes only that copy: a plain synchronous
clone, and a "copy done" event that is already done, so the base class's get_finished() and its file protocol
(the file, its `.lock` held while writing) run unchanged and do not depend on the CPU worker's torch.cuda
placeholders. On a GPU build, use vLLM's own class (its files carry none of the metadata below: route vllm then
needs `vllm.accept_unverified_files`).

Each file's safetensors metadata also says what the server is (`regen_server`, JSON): the layer ids it captured
(the draft config's eagle_aux_hidden_state_layer_ids), the model (model_config.model, the served names), its
hidden size, layer count, vocabulary and dtype. regen's route vllm checks them against its capture layout and model
(vLLM's own files carry no such metadata).
"""
import fcntl
import json
import os
from functools import partial

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _CopyDone:
    """Stands for the CUDA event the base class records after its device-to-host copy."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


METADATA_KEY = "regen_server"


def server_metadata(vllm_config) -> dict[str, str]:
    """What this server is, as the route checks it: the values vLLM itself runs with."""
    model_config = vllm_config.model_config
    draft = vllm_config.speculative_config.draft_model_config.hf_config
    served = model_config.served_model_name
    text = model_config.hf_text_config
    return {METADATA_KEY: json.dumps({
        "connector": "regen CpuHiddenStatesConnector",
        "layer_ids": [int(i) for i in getattr(draft, "eagle_aux_hidden_state_layer_ids", [])],
        "model": str(model_config.model),
        "served_model_name": list(served) if isinstance(served, (list, tuple)) else [str(served)],
        "hidden_size": int(model_config.get_hidden_size()),
        "num_hidden_layers": int(getattr(text, "num_hidden_layers")),
        "vocab_size": int(model_config.get_vocab_size()),
        "dtype": str(model_config.dtype).removeprefix("torch."),
    })}


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._regen_metadata = server_metadata(self._vllm_config)

    def _write_with_metadata(self, tensors, event, filename, lock_fd) -> None:
        """The base class's _write_tensors, with the server's metadata in the file."""
        try:
            event.synchronize()
            save_file(tensors, filename, metadata=self._regen_metadata)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block = self._block_size
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(block, dtype=torch.long).reshape(1, block) + block_ids.reshape(-1, 1) * block).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        assert self._req_futures.get(pending.req_id) is None, "duplicate req_id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _CopyDone()
        future = self._executor.submit(self._write_with_metadata, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
