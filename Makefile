# Every target works on a fresh machine: it makes .venv if missing and installs what it needs.
PY := .venv/bin/python
STAMP := .venv/.hpfun-installed

.PHONY: setup demo demo-module test validate-nightly decompositions-nightly hf-nightly fuzz-nightly docs clean

setup: $(STAMP)

# torch first, pinned to the CPU build on disk, so nothing later pulls a CUDA build; then hpfun
# with its dev extra at the versions constraints.txt names (what the suite was run against).
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hpfun.demo

# the same mesh and layouts for an nn.Module trained with torch.optim.AdamW, its state lifted by name
demo-module: $(STAMP)
	$(PY) -m hpfun.demo --module

# one worker per core (pytest-xdist), at most four: the suite is many small, single-threaded tests
test: $(STAMP)
	$(PY) -m pytest -n auto --maxprocesses 4

# every rule against unsharded ground truth, with many more examples than the suite draws
validate-nightly: $(STAMP)
	$(PY) -m hpfun.validate --max-examples 200

# capture's decompositions against torch's kernels on every OpInfo (forward and vjp, float64, ~1 min)
decompositions-nightly: $(STAMP)
	$(PY) -m hpfun.testing.decompositions

# 48 Hugging Face models, tiny, trained two steps as written: data parallel, their own
# tensor-parallel plan, ZeRO-3, each against the same step run eagerly (~5 min)
hf-nightly: $(STAMP)
	$(PY) -m hpfun.testing.hf_sweep

# whole random programs against the unsharded run: thousands with a fresh seed (the suite runs a
# fixed 120), with the verifier on; FUZZ_EXAMPLES and FUZZ_SEED override; report in build/fuzz-nightly.txt
FUZZ_EXAMPLES ?= 3000
FUZZ_SEED ?= $(shell date +%Y%m%d)
fuzz-nightly: $(STAMP)
	HPFUN_VERIFY=1 $(PY) -m hpfun.testing.fuzz --examples $(FUZZ_EXAMPLES) --seed $(FUZZ_SEED) --out build/fuzz-nightly.txt

# Notebook 03 (committed with its outputs) as HTML, and a screenshot of it by headless Chromium,
# so a person can see the report's and the layouts' HTML views render. Chromium comes from apt.
DOCS := build/docs
docs: $(STAMP)
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)
	$(PY) -m nbconvert --to html --output-dir $(DOCS) notebooks/03_tensor_parallel_block.ipynb
	profile=$$(mktemp -d) && chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
		--disable-background-networking --disable-component-update --disable-sync --user-data-dir=$$profile \
		--hide-scrollbars --window-size=1280,6000 --screenshot=$(CURDIR)/$(DOCS)/03_tensor_parallel_block.png \
		file://$(CURDIR)/$(DOCS)/03_tensor_parallel_block.html; status=$$?; rm -rf $$profile; exit $$status
	@echo "wrote $(DOCS)/03_tensor_parallel_block.html and $(DOCS)/03_tensor_parallel_block.png"

clean:
	rm -rf .venv build *.egg-info .pytest_cache .hypothesis
