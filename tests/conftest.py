"""Shared, expensive fixtures: one Ray cluster and one local llama.cpp fleet per test session, and a vLLM fleet
per module that asks for it (about 4 GB a server: stopped when the module ends, before other heavy fixtures).

Ray runs as a real head node (`ray start --head`) in a private temp dir; every `regen generate`
subprocess joins it through RAY_ADDRESS, as a driver on a real head node would.
"""
from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import free_port, require_installed

REPO = Path(__file__).resolve().parent.parent
TOOL_TEMPLATE = REPO / "configs/templates/smollm2_tools.jinja"
# Test credentials for the local S3 server (moto), set before the Ray head starts so that its workers (the
# capture actors that write hidden-state parts) inherit them, as they would a node's real credentials.
for _key, _value in {"AWS_ACCESS_KEY_ID": "regen-test", "AWS_SECRET_ACCESS_KEY": "regen-test",
                     "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
    os.environ.setdefault(_key, _value)
# The test cluster is loopback-only (Ray binds 127.0.0.1 instead of the machine's interface address) and needs
# no auth token. Set before any test module is collected: Ray reads the loopback switch when it is first
# imported, and a test module that imports Ray at collection time would otherwise make this process's own
# ray.init() look for the head on the interface address, and hang.
os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")


# Test modules that start real vLLM servers (about 4 GB each): one xdist worker runs them one after another.
REAL_VLLM_MODULES = {"test_vllm_engine.py", "test_vllm_capture.py", "test_vlm_engine.py"}
GROUP = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under `-n N --dist loadgroup` (make test), each module runs whole on one worker, so that its module
    fixtures start once; the real-vLLM modules share one worker, so that at most one vLLM fleet runs at a time.
    Each worker has its own session fixtures (Ray head, fleets), on free ports and its own temp dirs."""
    groups: dict[str, int] = collections.Counter()
    for item in items:
        module = item.path.name
        group = "real-vllm" if module in REAL_VLLM_MODULES else module
        item.add_marker(pytest.mark.xdist_group(group))
        item.stash[GROUP] = group
        groups[group] += 1
    # The order xdist hands the groups out in (its own reordering is off, pytest_configure): the real-vLLM group
    # first, as it is the longest (about ten minutes on one worker), then the others by their count of tests, as
    # xdist would. Handed out last, it ran alone at the end while the other worker idled.
    rank = {group: (group != "real-vllm", -count) for group, count in groups.items()}
    items.sort(key=lambda item: rank[item.stash[GROUP]])  # stable: a module's tests keep their order


def pytest_configure(config):
    """Refuse, on the controller (a worker's error would show only as an INTERNALERROR), a loadgroup run under
    pytest 9: xdist 3.8 cannot set its item ids there, so every module would be split across the workers and its
    fixtures, the vLLM fleets included, started on each."""
    if config.getoption("dist", "no") == "loadgroup" and int(pytest.__version__.split(".")[0]) >= 9:
        raise pytest.UsageError(f"pytest {pytest.__version__}: pytest-xdist's --dist loadgroup does not group under "
                                "pytest 9; install the dev extra's pins (pip install -e '.[dev]': pytest < 9)")
    if config.getoption("dist", "no") == "loadgroup":
        config.option.loadscopereorder = False  # the groups go out in the order pytest_collection_modifyitems sets


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A Ray head on 127.0.0.1 for the session. Yields its address and temp dir (for log greps)."""
    temp_dir = Path(f"/tmp/regen-ray-{os.getpid()}")  # short: Ray's socket paths have a length limit
    shutil.rmtree(temp_dir, ignore_errors=True)
    port = free_port()
    ray_bin = str(Path(sys.executable).with_name("ray"))
    subprocess.run(
        [ray_bin, "start", "--head", f"--port={port}", "--num-cpus=2",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"],
        check=True, capture_output=True,
    )
    address = f"127.0.0.1:{port}"
    os.environ["RAY_ADDRESS"] = address
    yield {"address": address, "temp_dir": temp_dir}
    os.environ.pop("RAY_ADDRESS", None)
    stop_cluster(temp_dir)
    shutil.rmtree(temp_dir, ignore_errors=True)


def stop_cluster(temp_dir: Path) -> None:
    """Stop this session's Ray head only (`ray stop` would stop every Ray cluster on the machine)."""
    import psutil

    ours = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(temp_dir) in arg for arg in proc.info["cmdline"] or []):
                ours += [proc, *proc.children(recursive=True)]  # the raylet's workers and actors too
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for proc in ours:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(ours, timeout=10)


@pytest.fixture(scope="session")
def llama_fleet(tmp_path_factory):
    """Two llama.cpp servers (SmolLM2-135M) on 127.0.0.1, each with 4 slots of 512 tokens."""
    pytest.importorskip("xllamacpp")
    from pipeline.core.config import LocalFleet
    from pipeline.endpoints.localfleet import LocalFleetProcesses

    fleet = LocalFleet(servers=2, base_port=free_port(), slots=4, ctx_per_slot=512, threads=1)
    # base_port + 1 must be free too
    processes = LocalFleetProcesses(fleet, tmp_path_factory.mktemp("llama-logs")).start()
    yield fleet
    processes.stop()


@pytest.fixture(scope="module")
def vllm_fleet(tmp_path_factory):
    """Two vLLM servers (its CPU build, SmolLM2-135M float32) on 127.0.0.1, one core each, 4 sequences of 1024
    tokens, serving tools (configs/templates/smollm2_tools.jinja, --tool-call-parser hermes). Yields the fleet config and its processes (a test may SIGKILL one: put that test last)."""
    from pipeline.core.config import LocalFleet
    from pipeline.endpoints.localfleet import LocalFleetProcesses, vllm_model_dir, vllm_python

    if not vllm_python().exists() or not (vllm_model_dir() / "config.json").exists():
        require_installed(f"vLLM's venv ({vllm_python()}) or model ({vllm_model_dir()})")
    # with the project's tool template (tool-free chats render as SmolLM2's own) and the hermes tool-call parser
    fleet = LocalFleet(engine="vllm", servers=2, base_port=free_port(), slots=4, ctx_per_slot=1024, threads=1,
                       chat_template=str(TOOL_TEMPLATE), tool_call_parser="hermes")
    processes = LocalFleetProcesses(fleet, tmp_path_factory.mktemp("vllm-logs")).start()
    yield SimpleNamespace(fleet=fleet, processes=processes, model_dir=vllm_model_dir())
    processes.stop()


@pytest.fixture(scope="session")
def emulator_fleet(tmp_path_factory):
    """Two SGLang-faithful emulators (Kimi preset, instant answers), each with its own request log."""
    from pipeline.emulator import start_emulator

    logs = tmp_path_factory.mktemp("emulator-logs")
    servers = [start_emulator(preset="kimi", request_log=str(logs / f"e{i}.jsonl")) for i in range(2)]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def object_store(tmp_path_factory):
    """A real S3 HTTP server on 127.0.0.1 (moto's server, in its own process) with one bucket. Yields the
    URI of a fresh prefix maker: object_store("name") -> s3://regen-test/name?endpoint_override=..."""
    pytest.importorskip("moto")
    import time
    import urllib.request

    import pyarrow.fs as pafs

    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the moto S3 server did not start")
            time.sleep(0.2)
    options = f"endpoint_override=127.0.0.1:{port}&scheme=http"
    pafs.FileSystem.from_uri(f"s3://regen-test/?{options}&allow_bucket_creation=true")[0].create_dir("regen-test")
    yield lambda prefix: f"s3://regen-test/{prefix}?{options}"
    proc.kill()
    proc.wait()
    log.close()


@pytest.fixture(autouse=True, scope="module")
def no_ray_connection_left_to_the_next_module():
    """A module that ran `regen generate` in this process may leave this process joined to the test cluster (the
    session's early actors join it); the next module's own ray.init would then fail. Each module ends it."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(autouse=True)
def regen_logger_as_it_was():
    """A test that runs `regen generate` in this process (cli.main) leaves the run's setup_logging (dispatch/stopping.py) in place: the
    "regen" logger then writes to that run's log and no longer propagates, so a later test's caplog sees nothing.
    Each test gets the logger back as it found it."""
    import logging

    logger = logging.getLogger("regen")
    handlers, propagate, level = list(logger.handlers), logger.propagate, logger.level
    yield
    for handler in list(logger.handlers):
        if handler not in handlers:
            logger.removeHandler(handler)
            handler.close()
    logger.propagate, logger.level = propagate, level
