"""Route vllm against misconfigured capture servers (tests/fake_capture_server.py: vLLM's connector protocol, tiny
random states): each failure leaves as the error class that decides what the pool does, naming the server and
what it serves, and the route deletes only the file its own request made. The real server's metadata and states
are checked in tests/test_vllm_capture.py."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from pipeline.core.capture_config import CaptureConfig
from pipeline.core.errors import ConnectionDropped, ContractError, EndpointDown, Retryable, TerminalForPrompt
from pipeline.hidden.errors import CaptureSampleError
from pipeline.hidden.vllm_route import RequestOwner, VllmRoute
from tests.fake_capture_server import FakeCaptureServer, tiny_model_folder
from tests.helpers import wait_for

AUX_IDS, LAYERS, HIDDEN = [1, 3, 4], 6, 8
IDS = [5, 9, 11, 2, 7]


@pytest.fixture
def model(tmp_path):
    return tiny_model_folder(tmp_path / "SmolTiny", LAYERS, HIDDEN)


@pytest.fixture
def server(tmp_path, model):
    fake = FakeCaptureServer(tmp_path / "server-files", str(model), AUX_IDS + [LAYERS], HIDDEN, LAYERS).start()
    yield fake
    fake.stop()


def route_for(server, model, **vllm) -> VllmRoute:
    cfg = CaptureConfig.model_validate({"route": "vllm", "model": str(model), "aux_layer_ids": AUX_IDS,
                                        "vllm": {"url": server.url, "timeout_s": 5, "lock_timeout_s": 5,
                                                 "visible_timeout_s": 0.5, **vllm}})
    return VllmRoute(cfg, RequestOwner("cap0123", "sess1"))


def test_a_server_of_the_capture_layout_gives_its_states_in_layout_order_and_its_file_is_removed(server, model):
    states = route_for(server, model).capture(IDS)
    assert states.shape == (len(IDS), 5, HIDDEN)  # aux x3, post-norm, pre-norm
    written = np.random.default_rng(len(IDS)).standard_normal((len(IDS), 4, HIDDEN)).astype(np.float32)
    np.testing.assert_array_equal(states[:, [0, 1, 2, 4]], written)  # the aux layers, then L before the norm
    rms = np.sqrt(np.mean(written[:, 3].astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(states[:, 3], written[:, 3] / rms * np.linspace(0.5, 1.5, HIDDEN), rtol=1e-5)
    wait_for(lambda: server.files() == [], timeout=30, what="the server's file removed")


@pytest.mark.parametrize("field, value, named", [
    ("layer_ids", [1, 2, 3, LAYERS], "layer_ids [1, 2, 3, 6] (capture expects [1, 3, 4, 6])"),
    ("model", "/models/OtherTiny", "model /models/OtherTiny (capture expects"),
    ("hidden_size", 2 * HIDDEN, "hidden_size 16 (capture expects 8)"),
])
def test_a_server_that_captures_other_layers_or_serves_another_model_is_refused_at_the_first_sample(
        server, model, field, value, named):
    server.metadata = {"layer_ids": AUX_IDS + [LAYERS], "model": str(model), "hidden_size": HIDDEN,
                       "num_hidden_layers": LAYERS, field: value}
    with pytest.raises(ContractError) as refused:
        route_for(server, model).capture(IDS)
    assert server.url in str(refused.value) and named in str(refused.value)


def test_a_server_whose_models_root_is_another_model_is_refused_at_start(server, model):
    server.model = "/models/OtherTiny"
    with pytest.raises(ContractError, match="serves /models/OtherTiny .*expects .*SmolTiny"):
        route_for(server, model)
    assert route_for(server, model, server_model="/models/OtherTiny").model == "served"  # named on purpose


def test_a_file_without_regens_metadata_is_refused_unless_unverified_files_are_accepted(server, model):
    server.metadata = {}
    with pytest.raises(ContractError, match="regen_hidden_states_connector"):
        route_for(server, model).capture(IDS)
    assert route_for(server, model, accept_unverified_files=True).capture(IDS).shape == (len(IDS), 5, HIDDEN)


@pytest.mark.parametrize("per_token, width", [(1, HIDDEN), (4, 2 * HIDDEN)])
def test_a_file_of_another_shape_or_width_is_a_contract_error(server, model, per_token, width):
    server.metadata, server.states_per_token, server.hidden_size = {}, per_token, width
    with pytest.raises(ContractError, match=r"expects \[5, 4, 8\]"):
        route_for(server, model, accept_unverified_files=True).capture(IDS)


def test_a_folder_this_host_cannot_see_is_a_contract_error_within_seconds(server, model, tmp_path):
    server.answer_path = lambda file: f"{tmp_path}/no-such-mount/{file.name}"
    started = time.monotonic()
    with pytest.raises(ContractError, match="no-such-mount.*shared with the capture actors"):
        route_for(server, model).capture(IDS)
    assert time.monotonic() - started < 2  # not lock_timeout_s per prompt
    elsewhere = tmp_path / "same-path-other-host"
    elsewhere.mkdir()
    server.answer_path = lambda file: str(elsewhere / file.name)  # a folder here, but not the server's
    with pytest.raises(ContractError, match="same-path-other-host"):
        route_for(server, model).capture(IDS)


def test_an_unreachable_dropped_or_hung_server_is_endpoint_down_or_retryable_not_a_raw_urlerror(server, model):
    server.drop_connection = True
    with pytest.raises(ConnectionDropped):
        route_for(server, model, timeout_s=60).capture(IDS)  # however late the server's thread drops it
    route = route_for(server, model, timeout_s=60)  # its start asks /v1/models: never timed out on a loaded machine
    route.opts = route.opts.model_copy(update={"timeout_s": 0.5})
    server.drop_connection, server.answer_delay_s = False, 1.5  # never answers within the timeout
    with pytest.raises(Retryable) as hung:
        route.capture(IDS)
    assert not isinstance(hung.value, EndpointDown)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        route.url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
    with pytest.raises(EndpointDown) as down:
        route.capture(IDS)
    assert not isinstance(down.value, ConnectionDropped)


def test_a_sample_the_server_refuses_fails_alone(server, model):
    route = route_for(server, model)
    server.error = (400, "This model's maximum context length is 8 tokens. However, you requested 9 tokens")
    with pytest.raises(CaptureSampleError) as refused:
        route.capture(IDS)
    assert isinstance(refused.value, TerminalForPrompt) and "maximum context length" in str(refused.value)


def test_a_path_outside_the_servers_folder_or_of_another_request_is_refused_and_not_deleted(server, model, tmp_path):
    victim = tmp_path / "victim.safetensors"
    victim.write_text("a user's file")
    route = route_for(server, model)
    route.capture(IDS)  # the server's folder is now known
    server.answer_path = lambda file: str(victim)
    with pytest.raises(ContractError, match="nothing deleted"):
        route.capture(IDS)
    others = server.folder / "cmpl-someone-else-0.safetensors"
    others.write_text("another client's file")
    server.answer_path = lambda file: str(others)
    with pytest.raises(ContractError, match="nothing deleted"):
        route.capture(IDS)
    assert victim.exists() and others.exists()
    pinned = route_for(server, model, hidden_states_dir=str(tmp_path / "configured"))
    server.answer_path = None
    with pytest.raises(ContractError, match="configured"):
        pinned.capture(IDS)


def test_a_file_written_after_its_lock_timed_out_is_still_removed(server, model):
    route = route_for(server, model, lock_timeout_s=0.3)
    server.write_gate = threading.Event()  # the file is written once the route has given up on its lock
    with pytest.raises(Retryable, match="still locked"):
        route.capture(IDS)
    server.write_gate.set()
    wait_for(lambda: any(n.endswith(".safetensors") for n in server.files()), timeout=30, what="the late file")
    server.write_gate = None
    route.capture(IDS)
    wait_for(lambda: server.files() == [], timeout=30, what="every file of this route removed")


def test_capture_many_keeps_concurrency_requests_in_flight_and_returns_each_samples_outcome(server, model):
    route = route_for(server, model, concurrency=3, timeout_s=60)
    server.hold_until_in_flight = 3  # the first answers wait until three are in flight (30 s at most)
    outcomes = route.capture_many([list(range(1, k + 1)) for k in range(2, 8)])
    assert server.max_in_flight == 3 and route.pool._max_workers == 3
    assert [o.shape[0] for o in outcomes] == list(range(2, 8))
    server.answer_delay_s, server.error = 0.0, (400, "invalid prompt")
    outcomes = route.capture_many([IDS, IDS])
    assert len(outcomes) == 2 and all(isinstance(o, CaptureSampleError) for o in outcomes)


def test_captures_at_one_path_on_two_hosts_and_two_actors_name_their_requests_apart(server, model, monkeypatch):
    from pipeline.dispatch.capture_worker import CaptureWorker

    manifest = {"created_at": "2026-01-01T00:00:00+00:00"}
    cfg = route_for(server, model).cfg

    def owner_on(host: str, tag: str = "cap1s0g1", session: str = "sess1"):
        monkeypatch.setattr(socket, "gethostname", lambda: host)
        return CaptureWorker(cfg, "/home/ubuntu/outputs/run1/capture", tag, "fp", session, manifest).owner

    a, b = owner_on("host-a"), owner_on("host-b", session="sess2")  # one shared server, the same capture path
    assert a.capture_key != b.capture_key and owner_on("host-a").capture_key == a.capture_key
    assert owner_on("host-a", "cap1s1g1").request_id(1) != a.request_id(1)  # two actors of one session
    in_flight = server.folder / f"cmpl-{a.request_id(1)}-0-0badf00d.safetensors"  # host A's, being read
    in_flight.write_bytes(b"states")
    earlier = server.folder / f"cmpl-{b.request_id(1).replace('sess2', 'sess0')}-0-0badf00d.safetensors"
    earlier.write_bytes(b"states")  # left by host B's own earlier session
    VllmRoute(cfg, b).capture(IDS)
    assert in_flight.exists() and not earlier.exists()


@pytest.mark.parametrize("raw", ["not json {", "[1, 2, 3]", "null"])
def test_malformed_regen_metadata_is_a_contract_error_naming_the_server(server, model, raw):
    server.server_metadata = lambda: {"regen_server": raw}
    with pytest.raises(ContractError, match="regen_server metadata is not a JSON object") as refused:
        route_for(server, model).capture(IDS)
    assert server.url in str(refused.value)


def test_a_chunk_in_flight_charges_each_sample_its_share_and_a_fatal_error_wins(tmp_path):
    """The worker sends `vllm.concurrency` samples at once through `capture_many`: the ledger's capture_s sums to
    the route's real time (route_tok_s is right), and a ContractError anywhere in the chunk stops the pass before a
    sample failure earlier in it is charged to its prompt."""
    import time
    from types import SimpleNamespace

    from pipeline.core.errors import ContractError
    from pipeline.dispatch.capture_worker import CaptureWorker, Sample
    from pipeline.hidden.layout import CaptureLayout

    class InFlight:  # route vllm's surface: every request of the chunk in flight together
        def __init__(self, errors=None):
            self.opts = SimpleNamespace(concurrency=8)
            self.layout = CaptureLayout.build("m", 8, 4, None)
            self.errors = errors or {}

        def capture_many(self, many):
            time.sleep(0.4)
            return [self.errors.get(ids[0]) or np.zeros((len(ids), len(self.layout.states), 4), np.float32)
                    for ids in many]

    def worker(route):
        w = CaptureWorker(SimpleNamespace(route="vllm"), str(tmp_path / f"cap{id(route)}"), "t", "fp", owner_key="k")
        w.route = route
        return w

    prompts = [[Sample(f"p{i}", 0, f"s{i}", [i, 1, 2], 2, "stop")] for i in range(8)]
    started = time.perf_counter()
    rows = worker(InFlight()).capture(prompts)
    wall = time.perf_counter() - started
    assert sum(r[0]["capture_s"] for r in rows) <= wall  # not 8 x the chunk's time
    route = InFlight({0: CaptureSampleError("bad ids"), 1: ContractError("now serves another model", endpoint="u")})
    with pytest.raises(ContractError):
        worker(route).capture(prompts[:2])
