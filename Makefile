# Every target works on a fresh machine: it makes .venv if missing and installs what it needs.
PY := .venv/bin/python
STAMP := .venv/.hpfun-installed

.PHONY: setup demo test validate-nightly clean

setup: $(STAMP)

# torch first, pinned to the CPU build on disk, so nothing later pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hpfun.demo

test: $(STAMP)
	$(PY) -m pytest

# every rule against unsharded ground truth, with many more examples than the suite draws
validate-nightly: $(STAMP)
	$(PY) -m hpfun.validate --max-examples 200

clean:
	rm -rf .venv build *.egg-info .pytest_cache .hypothesis
