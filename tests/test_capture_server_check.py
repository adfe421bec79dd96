"""Route vllm against a capture server that serves another model than the capture's: the project's motivating
failure (a server returning 7168-wide states where the capture expects another width) stops the capture at its
first sample, naming both widths, and stores nothing. The server's side is a real safetensors file as the
connector writes it ([T, 4, H] states and the ids); only the HTTP request that names it is replaced."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import save_file

from pipeline.core.errors import ConfigError
from pipeline.dispatch.capture_worker import CaptureWorker, Sample
from pipeline.hidden.layout import CaptureLayout
from pipeline.hidden.parts import hidden_parts
from pipeline.hidden.vllm_route import RequestOwner, VllmRoute
from pipeline.store.rundir import RunDir

IDS = [1, 2, 3, 4, 5]


def route_served_by(tmp_path, served_width: int, layout_width: int = 64) -> VllmRoute:
    """A VllmRoute whose server answers every request with a file of `served_width`-wide states."""
    route = object.__new__(VllmRoute)
    route.layout = CaptureLayout.build("tiny", num_layers=8, hidden_size=layout_width)
    route.model_identity, route.url, route.model = {"config": "c"}, "http://capture-server:8000", "other/model"
    route.opts = SimpleNamespace(lock_timeout_s=5.0)
    route.owner, route.requests = RequestOwner("cap", "s1"), itertools.count()
    route.norm_weight, route.eps = np.ones(layout_width, dtype=np.float32), 1e-6
    served = tmp_path / "served"
    served.mkdir(exist_ok=True)

    def request(path, body=None, request_id=None):
        file = served / f"cmpl-{request_id}.safetensors"
        states = np.random.default_rng(0).standard_normal((len(body["prompt"]), 4, served_width)).astype(np.float32)
        save_file({"hidden_states": states, "token_ids": np.asarray(body["prompt"], dtype=np.int64)}, str(file))
        return {"kv_transfer_params": {"hidden_states_path": str(file)}}

    route._request = request
    return route


def test_a_server_of_the_capture_width_is_captured(tmp_path):
    states = route_served_by(tmp_path, served_width=64).capture(IDS)
    assert states.shape == (len(IDS), 5, 64)


@pytest.mark.parametrize("served_width", [32, 3 * 64])
def test_a_server_of_another_width_stops_the_capture_at_its_first_sample(tmp_path, served_width):
    cap = RunDir(tmp_path / "capture")
    worker = CaptureWorker(SimpleNamespace(), str(cap.path), "a0", "fp")
    worker.route = route_served_by(tmp_path, served_width)
    prompts = [[Sample(f"p{i}", 0, f"p{i}#turn0", IDS, 2, "stop")] for i in range(3)]
    with pytest.raises(ConfigError) as refused:  # not a CaptureSampleError: no prompt is failed alone
        worker.capture(prompts)
    assert f"returns {served_width}-wide hidden states, but capture.json's layout is 64 wide" in str(refused.value)
    assert "http://capture-server:8000" in str(refused.value) and "another model" in str(refused.value)
    assert hidden_parts(cap) == [], "nothing stored"
