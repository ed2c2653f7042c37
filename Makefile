# The two commands of the README, and what they need. Each sets itself up on a fresh machine.
#   make dev       the local stack: gateway + embedded AWS + mock model server
#   make test      the test suite
#   make bench     the benchmark harness (bench/): writes bench/results/ and docs/performance.md
# For deploying (docs/deploy.md):
#   make validate  sam validate --lint
#   make build     sam build (python3.13, arm64, precompiled), then checks the artifacts and
#                  what `sam local start-api` would serve in buffered mode

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# SAM CLI pins its own boto3, pydantic and cfn-lint: it lives in its own tool environment.
SAM_HOME ?= .tools/sam
SAM      := $(SAM_HOME)/bin/sam
SAM_ENV  := SAM_CLI_TELEMETRY=0 AWS_DEFAULT_REGION=$${AWS_DEFAULT_REGION:-us-east-1}

.PHONY: dev test lint audit setup validate build clean bench e2e-real

$(BIN)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is needed (found " + sys.version.split()[0] + ")")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[dev]'
	@touch $@

# the openai npm package the reference pages' JavaScript examples run with (Node's own npm)
EXAMPLES_JS := tests/examples/js
$(EXAMPLES_JS)/node_modules/.package-lock.json: $(EXAMPLES_JS)/package-lock.json
	cd $(EXAMPLES_JS) && npm ci --no-audit --no-fund --loglevel=error

# real clients the tests run in Node: the Vercel AI SDK's default OpenAI provider
CLIENTS_JS := tests/clients/js
$(CLIENTS_JS)/node_modules/.package-lock.json: $(CLIENTS_JS)/package-lock.json
	cd $(CLIENTS_JS) && npm ci --no-audit --no-fund --loglevel=error

# the OpenAI Agents SDK, a real client of /v1/responses, in an environment of its own (its
# dependencies are not the gateway's); tests/clients/test_clients_openai_agents.py runs it
AGENTS_HOME := .tools/agents
$(AGENTS_HOME)/.installed: tests/clients/py/requirements.txt | $(BIN)/.installed
	$(PYTHON) -m venv $(AGENTS_HOME)
	$(BIN)/uv pip install --quiet --python $(AGENTS_HOME)/bin/python -r tests/clients/py/requirements.txt
	@touch $@

setup: $(BIN)/.installed $(EXAMPLES_JS)/node_modules/.package-lock.json $(CLIENTS_JS)/node_modules/.package-lock.json \
       $(AGENTS_HOME)/.installed

dev: setup
	$(BIN)/kiln dev $(ARGS)

# the suite's tests each start their own servers on free ports: they run side by side, a worker
# per CPU (at most 4), in about two thirds of the time on two CPUs
test: setup
	$(BIN)/python -m pytest -n auto --maxprocesses=4 $(ARGS)

# Peers (LiteLLM, Portkey) and the bench's tools live in .bench/, outside the project venv.
bench: setup
	$(BIN)/python -m bench $(ARGS)

# tests/e2e_real against a real model server (llama.cpp + Gemma 3 270M on the CPU); the
# first run builds llama-cpp-python (a fresh run took 269 s on 2 cores), later runs about 20 s.
e2e-real: setup
	$(BIN)/kiln e2e-real $(ARGS)

lint: setup
	$(BIN)/ruff check layers infra functions tests bench

# pip-audit of the layer's pinned runtime dependencies, from its own tool environment
AUDIT_HOME ?= .tools/audit
$(AUDIT_HOME)/bin/pip-audit: | $(BIN)/.installed
	$(PYTHON) -m venv $(AUDIT_HOME)
	$(BIN)/uv pip install --quiet --python $(AUDIT_HOME)/bin/python pip-audit

audit: $(AUDIT_HOME)/bin/pip-audit
	rm -f .tools/audit.json
	$(AUDIT_HOME)/bin/pip-audit --requirement layers/gateway/requirements.txt --no-deps --disable-pip \
	    --format json --output .tools/audit.json --progress-spinner off || true
	$(BIN)/python infra/audit_report.py .tools/audit.json

# mutmut over the layer's pure modules, from its own tool environment, in a copy of the tree
# (.tools/mutation/work; the working tree is never mutated): a score per module, >= 90 % each.
# MODULES="metering sse" runs some of them only; docs/mutation.md has the last scores.
MUTATION_HOME ?= .tools/mutation
$(MUTATION_HOME)/bin/mutmut: | $(BIN)/.installed
	$(PYTHON) -m venv $(MUTATION_HOME)
	$(BIN)/uv pip install --quiet --python $(MUTATION_HOME)/bin/python mutmut==3.8.1 pytest httptools certifi

.PHONY: mutation
mutation: $(MUTATION_HOME)/bin/mutmut
	nice -n 19 $(MUTATION_HOME)/bin/python infra/mutation.py $(MODULES)

$(SAM): | $(BIN)/.installed
	$(PYTHON) -m venv $(SAM_HOME)
	$(BIN)/uv pip install --quiet --python $(SAM_HOME)/bin/python aws-sam-cli

validate: $(SAM)
	$(SAM_ENV) $(SAM) validate --lint --template template.yaml

build: $(SAM) setup
	$(SAM_ENV) $(SAM) build --template template.yaml
	$(BIN)/kiln verify-build .aws-sam/build
	env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY -u AWS_SESSION_TOKEN -u AWS_PROFILE \
	    AWS_CONFIG_FILE=/dev/null AWS_SHARED_CREDENTIALS_FILE=/dev/null $(SAM_ENV) \
	    $(SAM_HOME)/bin/python infra/sam_local_check.py .aws-sam/build/template.yaml

clean:
	rm -rf $(VENV) .tools .aws-sam .kiln .pytest_cache .bench
