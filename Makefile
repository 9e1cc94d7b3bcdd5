# The README's two commands: `make smoke` and `make test`. Both set up what they need first.
SHELL := /bin/bash
export PATH := $(CURDIR)/.venv/bin:$(PATH)
CORES ?= 2

.PHONY: setup smoke test lint clean-results

setup:
	bash scripts/setup.sh

STUDY ?= config/smoke.yaml

# validate first: Snakemake reads --configfile itself and names no file, line or column for a YAML error
smoke: setup
	python -m hybridrl validate --config $(STUDY) > /dev/null
	snakemake --cores $(CORES) --configfile $(STUDY) --printshellcmds
	@echo "report: results/report.html (and results/report.md)"

# the slowest tests are listed after the summary: CI runs this on 2 cores, where the suite takes ~13 minutes
test: setup
	python -m pytest -ra --durations=15

# what CI checks before the tests: Python style, the workflow's lint and its formatting
lint: setup
	ruff check src tests
	snakemake --lint --configfile config/smoke.yaml
	snakefmt --check Snakefile workflow

clean-results:
	rm -rf results/runs results/plots results/steps.* results/report.* results/archive .snakemake/metadata
