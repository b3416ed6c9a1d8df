# diffpolicy — the verbs people use. `make train` and `make test` set up what is missing first.
# Inside an active virtual environment or conda env, use it; otherwise make one in the checkout (.venv),
# since Debian's and Ubuntu's own Python refuse `pip install` outside one (PEP 668).
SYSTEM_PYTHON ?= python3
ifneq ($(VIRTUAL_ENV)$(CONDA_PREFIX),)
PYTHON ?= python3
VENV :=
else
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
endif
PIP := $(PYTHON) -m pip
# The CPU build of torch; on a CUDA machine: make setup TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>"
TORCH_SPEC ?= torch==2.13.0
APT_PACKAGES := libegl1 libgl1 libegl-mesa0 libgles2
# Inside the venv it describes, so `rm -rf .venv` (or a fresh clone) sets everything up again.
STAMP := $(if $(VENV),$(VENV)/.setup.stamp,.setup.stamp)
export MUJOCO_GL ?= egl
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup quick train test test-capped test-all bench lint format clean

$(STAMP): pyproject.toml Makefile
	@PKGS="$(APT_PACKAGES)"; \
	if [ -n "$(VENV)" ] && [ ! -x "$(PYTHON)" ] && ! $(SYSTEM_PYTHON) -c "import ensurepip" >/dev/null 2>&1; then \
		PKGS="$$PKGS python3-venv"; \
	fi; \
	if command -v dpkg >/dev/null 2>&1 && ! dpkg -s $$PKGS >/dev/null 2>&1; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends $$PKGS; \
	fi
	@if [ -n "$(VENV)" ] && [ ! -x "$(PYTHON)" ]; then \
		echo "creating the virtual environment $(VENV) (activate one first to install elsewhere)"; \
		rm -rf "$(VENV)"; $(SYSTEM_PYTHON) -m venv "$(VENV)"; \
	fi
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,deploy]"
	$(PYTHON) -m diffpolicy.ops || echo "CPU kernels not built; the pure-torch paths will be used"
	@touch $(STAMP)

setup: $(STAMP)  ## system packages, the venv (unless one is active), torch (CPU build), the project + dev extras

quick: $(STAMP)  ## the whole pipeline, small (conf/experiment/quick.yaml): about 2 minutes on 2 cores
	$(PYTHON) -m diffpolicy.train +experiment=quick $(ARGS)

train: $(STAMP)  ## the main job: collect, pre-train, PPO fine-tune, evaluate (ARGS="algo.iterations=2 ...")
	$(PYTHON) -m diffpolicy.train env=mujoco_pick $(ARGS)

test: $(STAMP)  ## the default test suite (CPU, ~minutes)
	$(PYTHON) -m pytest -q $(ARGS)

# The same suite with oneDNN, MKL and ATen's own kernels capped at AVX2: on a CPU with AVX-512 (or AMX) floats
# then take another path, so a figure that holds on one kind of CPU only fails here, not in a user's first run.
ISA_CAP ?= ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2
test-capped: $(STAMP)  ## the default test suite under the capped instruction set (x86-64)
	$(ISA_CAP) $(PYTHON) -m pytest -q $(ARGS)

test-all: $(STAMP)  ## also the slow training checks
	$(PYTHON) -m pytest -q -m "slow or not slow" $(ARGS)

# Every benchmark of diffpolicy.bench.BENCHMARKS except the long multi-run studies (diffpolicy.bench.STUDIES):
# demos_curve trains and evaluates BC at several demonstration counts and redraws docs/demos_curve.png, so it is
# run on its own (python -m diffpolicy.bench demos_curve). tests/test_bench.py checks this list.
BENCH ?= env gae sampler bimodal ppo_update stabledrl scaling serve encoders bc_step group_norm_mish demos_import

bench: $(STAMP)  ## every benchmark (BENCH="gae env" picks some), one JSON line each, into runs/bench.jsonl
	@mkdir -p runs
	@failed=""; for b in $(BENCH); do \
		if $(PYTHON) -m diffpolicy.bench $$b > runs/.bench.out; then \
			tail -n 1 runs/.bench.out | tee -a runs/bench.jsonl; \
		else \
			failed="$$failed $$b"; \
		fi; \
	done; rm -f runs/.bench.out; \
	if [ -n "$$failed" ]; then echo "benchmarks failed:$$failed" >&2; exit 1; fi

lint: $(STAMP)  ## ruff lint and format check
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format: $(STAMP)
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check --fix .

clean:  ## remove build outputs and the setup stamp (keeps .venv; `rm -rf .venv` to start over)
	rm -rf $(STAMP) .pytest_cache .ruff_cache build *.egg-info
