# Shared by the `sam build` Makefiles of the layer and the functions: the Lambda runtime is
# python3.13 on arm64, so dependencies come as aarch64 wheels and modules are precompiled
# by a python3.13 (from PATH or pyenv).

PY313 ?= $(shell for candidate in "$$(pyenv root 2>/dev/null)"/versions/3.13*/bin/python3.13 "$$(command -v python3.13)"; do \
	"$$candidate" -c "import sys; assert sys.version_info[:2] == (3, 13)" 2>/dev/null && { echo "$$candidate"; break; }; done)
PIP ?= python3 -m pip
PIP_AARCH64 = $(PIP) install --quiet --disable-pip-version-check --no-warn-conflicts --root-user-action=ignore \
	--no-compile --only-binary=:all: \
	--implementation cp --python-version 3.13 --abi cp313 \
	--platform manylinux2014_aarch64 --platform manylinux_2_28_aarch64 --platform manylinux_2_34_aarch64
# Hash-based, not timestamp-based, pycs: sam's zip dates every file 1980 and Lambda's file
# system is read-only, so timestamp pycs would look stale and be recompiled at every cold start.
PRECOMPILE = $(PY313) -m compileall -q -j 0 --invalidation-mode unchecked-hash

check-py313:
	@test -n "$(PY313)" || { echo "python3.13 is needed to precompile for the Lambda runtime (pyenv install 3.13)" >&2; exit 1; }
.PHONY: check-py313
