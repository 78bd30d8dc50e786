# Two entry points for a fresh machine: `make run` and `make test`.
# The interpreter of .venv: the first of these that can make a venv and has its C headers (for the
# compiled modules, which otherwise fall back to pure Python). Debian's python3.11 (linked
# statically, built with Debian's optimizations) runs Python code ~17 % faster than a plain source
# build of 3.11.7 such as pyenv's; the broker's figures gained 0-20 % (docs/performance-history.md);
# `make PY=...` picks another.
PY ?= $(firstword $(foreach p,/usr/bin/python3.11 python3.11 python3,$(shell $(p) -c "import ensurepip, os, sys, sysconfig, venv; sys.exit(not os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))" >/dev/null 2>&1 && echo $(p))))
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-fast lint bench bench-mqtt clean system-deps fuzz

$(BIN)/python:
	$(if $(PY),$(PY) -m venv $(VENV) || )python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel

# Re-installed (and the Cython modules rebuilt) when the dependencies or a .pyx change.
$(STAMP): pyproject.toml setup.py $(wildcard */*.pyx */*/*.pyx */*.pxd */*/*.pxd) | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

system-deps:
	@bash scripts/system-deps.sh

# make run ARGS="--mqtt-port 1884 --set fsync=never" passes the flags to `lightgate serve`.
run: $(STAMP)
	$(BIN)/lightgate serve $(ARGS)

test: $(STAMP) system-deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy store/ lightqueue/ notify/ mqtt_proxy/ lightgate/ spark_analytics/
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 3 --dist loadfile --durations=15

# The inner loop: lint, then every test but the `slow` and `spark` ones.
test-fast: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 3 --dist loadfile -m "not slow and not spark"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy store/ lightqueue/ notify/ mqtt_proxy/ lightgate/ spark_analytics/

# make fuzz SECONDS=300 [SEED=n]: hypothesis properties of both codecs, then the socket fuzzer
# against a fresh gateway (docs/security.md, "Fuzzing").
SECONDS ?= 300
fuzz: $(STAMP)
	$(BIN)/python tests/fuzz_all.py --seconds $(SECONDS) $(if $(SEED),--seed $(SEED))

bench: $(STAMP)
	$(BIN)/python bench/store_bench.py

# MQTT: Lightgate (both shapes) vs Mosquitto vs amqtt in one run (installs Mosquitto if missing).
bench-mqtt: $(STAMP)
	bash bench/mqtt_baseline.sh $(ARGS)

# clean also removes what `pip install -e .` compiled in place (setup.py: the Cython modules).
clean:
	rm -rf $(VENV) data analytics .pytest_cache build
	rm -f store/*.so mqtt_proxy/*.so mqtt_proxy/*/*.so lightqueue/*.so store/_c*.c store/_slots.c store/_fsync.c \
		mqtt_proxy/*/_c*.c lightqueue/_cblocks.c \
		lightqueue/_cindex.c lightqueue/_cresolve.c
