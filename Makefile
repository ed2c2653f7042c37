# The two commands of the README, and what they need. Each sets itself up on a fresh machine.
#   make dev    the local stack: gateway + embedded AWS + mock model server
#   make test   the test suite

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: dev test setup clean

$(BIN)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is needed (found " + sys.version.split()[0] + ")")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[dev]'
	@touch $@

setup: $(BIN)/.installed

dev: setup
	$(BIN)/kiln dev $(ARGS)

test: setup
	$(BIN)/python -m pytest $(ARGS)

clean:
	rm -rf $(VENV) .kiln .pytest_cache
