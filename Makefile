# The main job and the tests, one command each.
#   make demo    fresh machine -> install -> tiny iso-depth sweep -> fit phi -> cards (~10 min, 2 CPU cores)
#   make test    install, then the test suite (offline, CPU) without the few multi-process end-to-end
#                tests marked slow, on 2 workers; `make test-slow` runs those (CI runs both)
# Re-running `make demo` resumes the sweep where it stopped.

PYTHON ?= python
TORCH_VERSION ?= 2.13.0
# Extra pip arguments for torch. An unpinned torch pulls a multi-GB CUDA build; on a Linux machine
# without a local wheel mirror, use the CPU wheels:
#   make demo TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
RECIPE ?= recipes/iso_depth_tiny.yaml
OUT ?= runs/iso_depth_tiny
CARD_DIR ?= model_cards/iso_depth_tiny
BOOTSTRAP ?= 200
# Runs trained at once (empty: the sweep's default, cores // the recipe's torch_num_threads).
JOBS ?=

export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

# pytest-xdist workers for `make test` and `make test-slow` (each runs torch on one thread).
TEST_WORKERS ?= 2

.PHONY: install demo test test-slow lint

# torch first and pinned, so that `pip install -e .` (torch>=2.5) finds it satisfied.
install:
	$(PYTHON) -m pip install "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS)
	$(PYTHON) -m pip install -e ".[test]"

demo: install
	$(PYTHON) -m looped_hf demo --recipe $(RECIPE) --out $(OUT) --card-dir $(CARD_DIR) --bootstrap $(BOOTSTRAP) $(if $(JOBS),--jobs $(JOBS))

test: install
	$(PYTHON) -m pytest tests -m "not slow" -n $(TEST_WORKERS) --durations=10

test-slow:
	$(PYTHON) -m pytest tests -m slow -n $(TEST_WORKERS) --durations=10

lint:
	ruff check .
