"""The layers at run time: what importing a bottom-layer module really loads, in a fresh interpreter. The
import-linter contract (`make test`) checks the static imports; this catches dynamic ones and the root package."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

HIGHER = ("pipeline.endpoints", "pipeline.dispatch", "pipeline.hidden", "pipeline.export", "pipeline.run",
          "pipeline.cli", "pipeline.tools", "pipeline.bench", "pipeline.emulator")
NETWORK = ("ray", "aiohttp", "openai", "httpx", "requests")


@pytest.mark.parametrize("module", ["pipeline", "pipeline.core.config", "pipeline.core.work", "pipeline.core.errors",
                                    "pipeline.prompts.prompt_set", "pipeline.prompts.sources",
                                    "pipeline.store.rundir", "pipeline.store.records", "pipeline.store.progress"])
def test_a_bottom_layer_module_loads_no_higher_layer_and_no_network_client(module):
    code = f"import sys, json; import {module}; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       cwd=REPO).stdout)
    higher = [m for m in loaded if m.startswith(HIGHER)]
    network = [m for m in loaded if m.split(".")[0] in NETWORK]
    assert not higher and not network, f"{module} loads {higher + network}"
