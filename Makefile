# Cleave — the verbs. `make run` and `make test` take a fresh machine to a
# running cluster and a passing suite; each installs what it needs.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?= .cache/demo-model
PORT ?= 8000

# Binaries the tests start for real, as `binary:debian-package`; installed with apt-get when missing.
SYSTEM_DEPS := redis-server:redis-server promtool:prometheus docker-compose:docker-compose

.PHONY: system-deps install run test test-gpu bench-gpu lint protos protos-check dashboards bench demo-model clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found; install Python 3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch 2.13.0 lies on this machine's disk; pinning it avoids a CUDA download.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,nixl]'
	touch $(STAMP)

install: $(STAMP)

$(MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/cleave demo-model $(MODEL)

demo-model: $(MODEL)/config.json

run: $(STAMP) $(MODEL)/config.json
	$(VENV)/bin/cleave serve --model $(MODEL) --port $(PORT)

system-deps:
	@missing=""; for dep in $(SYSTEM_DEPS); do command -v $${dep%%:*} >/dev/null || missing="$$missing $${dep#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  sudo=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q --no-install-recommends $$missing; \
	fi

test: $(STAMP) system-deps protos-check
	$(PY) -m pytest -q -x tests

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests/gpu

# The GPU measurements (kernel bandwidth, Llama-3.2-1B-shaped throughput, decode roofline).
bench-gpu: $(STAMP)
	PY=$(PY) tests/gpu/run_device_checks.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check shared services tests
	$(VENV)/bin/ruff format --check shared services tests
	$(VENV)/bin/mypy shared services

protos: $(STAMP)
	$(PY) -m shared.tools.gen_protos

protos-check: $(STAMP)
	$(PY) -m shared.tools.gen_protos --check

# deploy/grafana/dashboards/*.json from shared/tools/gen_dashboards.py (a unit test checks they are fresh).
dashboards: $(STAMP)
	$(PY) -m shared.tools.gen_dashboards

# Cleave and the two transformers baselines, one after the other on the same workload.
bench: $(STAMP) $(MODEL)/config.json
	for backend in cleave hf hf-cb; do $(VENV)/bin/cleave bench throughput --model $(MODEL) --backend $$backend; done

clean:
	rm -rf $(VENV) .cache .pytest_cache
