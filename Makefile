# Two commands do all set-up on a fresh machine:
#   make run   - virtual environment, install, run the agent on the embedded defaults
#   make test  - the above plus the Debian packages the tests use, then ruff, mypy --strict, pytest
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.gpuwarden-run
TEST_STAMP := $(VENV)/.gpuwarden-test
# torch is pinned for tests: 2.13.0 is a CPU build already on these machines' disks, while an
# unpinned torch pulls a CUDA build of several GB. The daemon never imports it.
TORCH ?= torch==2.13.0
# Debian packages the tests run for real: a broker, promtool and Prometheus, Alertmanager and
# amtool, systemd-analyze, and node_exporter for the side-by-side benchmarks; lintian checks
# the Debian package.
DEBS := mosquitto mosquitto-clients prometheus prometheus-alertmanager prometheus-node-exporter systemd openssl libfuse2 fuse slurm-wlm munge lintian
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=
# Ansible's apt module on this host needs python3-apt (tests/test_ansible_role.py).
DEBS += python3-apt
# gpuwarden scan reads journals and rotated logs: systemd-journal-remote makes a real journal
# file, journalctl writes its output modes, and the compressors make what logrotate leaves.
DEBS += systemd-journal-remote zstd xz-utils bzip2 gzip
# glibc's locale sources, which the tests compile with localedef to check the month and day
# names that date and journalctl write in each locale (tests/support/locales.py).
DEBS += locales

.PHONY: run test check lint typecheck unit debs bench clean install deb

# The agent alone: no torch, no test tools.
$(RUN_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e .
	touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]' '$(TORCH)'
	touch $(TEST_STAMP)

run: $(RUN_STAMP)
	$(VENV)/bin/gpuwarden run $(ARGS)

debs:
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

test: debs $(TEST_STAMP)
	$(MAKE) --no-print-directory check VENV=$(VENV)

check: lint typecheck unit

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

typecheck:
	$(VENV)/bin/mypy

unit:
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

bench: $(TEST_STAMP)
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# Install onto this machine (or into DESTDIR=stage): venv in PREFIX, units, sysusers.d entry,
# example configuration, alert rules and dashboard (scripts/install.sh says more).
PREFIX ?= /opt/gpuwarden
install:
	DESTDIR='$(DESTDIR)' PREFIX='$(PREFIX)' PYTHON='$(PYTHON)' RUNBOOK_URL='$(RUNBOOK_URL)' \
		sh scripts/install.sh

# The Debian package: dist/gpuwarden_<version>_<arch>.deb (scripts/build_deb.py, docs/package.md).
# DEB_PYTHON is the target's interpreter: the package's venv links to it.
DEB_PYTHON ?= /usr/bin/python3
DEB_STAMP := $(VENV)/.gpuwarden-deb
$(DEB_STAMP): $(RUN_STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check 'setuptools==84.2.1'
	touch $(DEB_STAMP)

deb: $(DEB_STAMP)
	$(PY) scripts/build_deb.py --python '$(DEB_PYTHON)' --runbook-url '$(RUNBOOK_URL)' --out dist $(DEB_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache dist
