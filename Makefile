# The two commands of the README: `make demo` and `make test`.
# Both create the project's virtual environment (.venv) and install what they need on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

# The other Spark versions `make test` tries, each in its own environment made on first use like .venv
# (docs/where-it-runs/spark-versions.md): Databricks 17.3 LTS (Spark 4.0), 18 LTS (Spark 4.1) and, for the sink,
# 16.4 LTS (Spark 3.5). The development pin (.venv) is Spark 4.2, Databricks 19.
SPARK_VERSIONS := 4.0 4.1 3.5
PINS_4.0 := 'pyspark[connect]==4.0.2' 'delta-spark==4.0.1'
PINS_4.1 := 'pyspark[connect]==4.1.0' 'delta-spark==4.1.0' 'importlib-metadata>=1'
# Spark 3.5: pyspark keeps numpy < 2, which pyarrow 20 and later refuse; 3.5.7 is the newest 3.5 whose Connect
# server is on Maven Central (pip's pyspark 3.5 does not ship it)
PINS_3.5 := 'pyspark[connect]==3.5.7' 'delta-spark==3.3.2' 'pyarrow<20'
SPARK_VENVS := $(foreach v,$(SPARK_VERSIONS),.venv-spark$(v))
# on the other versions: the Spark tests of the sink, both sources, the syphon job and dedupe, where the outcome
# depends on Spark or Delta (the data source API, the commit protocol, a row's types, Delta tables, Connect, the
# jobs); not those of spark_sb's own logic, the same Python on every Spark (pyproject.toml: spark_independent)
EVERY_SPARK := -m 'every_spark and not spark_independent'

# An environment gets the requirements of pyproject.toml (its dependencies and the extras named, an extra that names
# spark-sb[...] unfolded), then spark-sb itself (--no-deps -e .) under a lock on the project folder: setuptools writes
# spark_sb.egg-info there, and make test makes its environments side by side.
REQUIREMENTS = $(PYTHON) -c 'import re, sys, tomllib; project = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
  unfold = lambda extras: [r for e in extras for d in project["optional-dependencies"][e] \
                           for r in (unfold(d[9:-1].split(",")) if re.fullmatch(r"spark-sb\[.*\]", d) else [d])]; \
  print("\n".join(project["dependencies"] + unfold(sys.argv[1:])))'

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(REQUIREMENTS) dev > $(VENV)/requirements.txt
	$(PY) -m pip install -q -r $(VENV)/requirements.txt
	flock . $(PY) -m pip install -q --no-deps -e .
	touch $@

.venv-spark%/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv .venv-spark$*
	.venv-spark$*/bin/python -m pip install -q --upgrade pip
	@$(REQUIREMENTS) emulator test > .venv-spark$*/requirements.txt
	.venv-spark$*/bin/python -m pip install -q -r .venv-spark$*/requirements.txt 'pyarrow>=15' 'pandas<3' \
	  'matplotlib>=3.8' $(PINS_$*)
	flock . .venv-spark$*/bin/python -m pip install -q --no-deps -e .
	touch $@

# The Java SDK's scenarios (tests/sdks/java, run by tests/sdks/test_java_sdk.py): built on first use like .venv
JAVA_SDK := tests/sdks/java
$(JAVA_SDK)/target/.installed: $(JAVA_SDK)/pom.xml $(shell find $(JAVA_SDK)/src -name '*.java' 2>/dev/null)
	@command -v java >/dev/null && command -v mvn >/dev/null || \
	  { echo "the Java SDK tests need Java 17 (java) and Maven (mvn) on PATH" >&2; exit 1; }
	rm -rf $(JAVA_SDK)/target/dependency
	cd $(JAVA_SDK) && mvn -q -B package dependency:copy-dependencies
	touch $@

# The JavaScript SDK's scenarios (tests/sdks/js, run by tests/sdks/test_js_sdk.py): @azure/service-bus from npm on first use
JS_SDK := tests/sdks/js
$(JS_SDK)/node_modules/.installed: $(JS_SDK)/package-lock.json
	@command -v node >/dev/null && command -v npm >/dev/null || \
	  { echo "the JavaScript SDK tests need Node.js (node) and npm on PATH" >&2; exit 1; }
	cd $(JS_SDK) && npm ci --silent --no-audit --no-fund
	touch $@

# The emulator page's browser tests (tests/emulator/test_page_browser.py) drive Debian's chromium with Playwright: made
# on first use where this user may install packages (root with apt-get), as a fresh CI machine is; elsewhere it says
# what to install
chromium:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  echo "installing Debian's chromium for the emulator page's browser tests" && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null || \
	    { apt-get update -q >/dev/null && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null; }; }; } || \
	  { echo "the emulator page's browser tests need Chromium on PATH (Debian: apt-get install chromium)" >&2; exit 1; }

.PHONY: chromium install demo test test-checked-no-spark test-suite test-no-spark test-spark test-spark-versions test-spark-4.0-then-3.5 $(SPARK_VERSIONS:%=test-spark-%) docs typecheck lint bench bench-quick chaos soak soak-cluster
# `make install`: .venv with everything the two commands use (spark-sb itself, editable, with the [dev] extras:
# the emulator, Spark and Delta, the tests' and the docs' tools), and nothing run
install: $(VENV)/.installed
	@echo ".venv is ready: .venv/bin/spark-sb, .venv/bin/spark-sb-writer, .venv/bin/spark-sb-syphon, .venv/bin/python"

demo: $(VENV)/.installed
	$(PY) jobs/demo.py

# `make test`: three tracks side by side, then the suite's Spark tests (test-spark) alone. The first track makes .venv,
# checks the docs and the types, then runs the suite's tests without Spark (test-no-spark, mostly waiting on the
# emulator); the other two make the other Spark versions' environments meanwhile, then run their Spark tests
# (test-spark-versions). test-spark runs alone: Spark Connect's Python worker must connect back within Spark's fixed
# 10 s, which it missed with two Spark suites beside it. Every part runs; any failing fails make test.
test:
	@$(MAKE) --no-print-directory -j3 test-checked-no-spark test-spark-versions; first=$$?; \
	  $(MAKE) --no-print-directory test-spark; spark=$$?; \
	  exit $$(( first || spark ))

test-checked-no-spark: $(VENV)/.installed $(JAVA_SDK)/target/.installed $(JS_SDK)/node_modules/.installed
	@$(MAKE) --no-print-directory docs typecheck; checked=$$?; $(MAKE) --no-print-directory test-no-spark; tests=$$?; \
	  exit $$(( checked || tests ))

# The suite on the development Spark (test-suite: both parts), three pytest processes on two cores: most tests wait
# on the emulator, Spark's triggers and their own short intervals, and every test's bounds hold on a loaded machine.
# Whole files go to a process, the files holding a slow test first (tests/conftest.py orders them).
WORKERS ?= 3
DIST := --dist loadfile --no-loadscope-reorder
test-suite: $(VENV)/.installed $(JAVA_SDK)/target/.installed $(JS_SDK)/node_modules/.installed
	@$(MAKE) --no-print-directory test-no-spark; first=$$?; $(MAKE) --no-print-directory test-spark; spark=$$?; \
	  exit $$(( first || spark ))

test-no-spark: $(VENV)/.installed $(JAVA_SDK)/target/.installed $(JS_SDK)/node_modules/.installed chromium
	@echo "== Spark 4.2 (.venv): the tests without Spark"
	$(PY) -m pytest -q -n $(WORKERS) $(DIST) --durations=10 --ignore=tests/spark

test-spark: $(VENV)/.installed
	@echo "== Spark 4.2 (.venv): the Spark tests"
	$(PY) -m pytest -q -n $(WORKERS) $(DIST) --durations=15 tests/spark

# The other Spark versions in two lanes, each on two pytest processes, its output kept together: 4.1, and 4.0 then
# 3.5 (whose suite is the sink's only: 4.0 and 3.5 together take about as long as 4.1)
test-spark-versions: $(SPARK_VENVS:%=%/.installed)
	@$(MAKE) --no-print-directory -j2 --output-sync=target test-spark-4.1 test-spark-4.0-then-3.5

test-spark-4.0-then-3.5:
	@$(MAKE) --no-print-directory test-spark-4.0; a=$$?; $(MAKE) --no-print-directory test-spark-3.5; b=$$?; \
	  exit $$(( a || b ))

# They keep xdist's order (the files with the most tests first), which runs the Connect test (one test) last: first,
# while the environments were still being made and every suite started its Spark, its foreachBatch Python worker
# missed Spark's fixed 10 s to connect back (Spark 4.1, the clean-clone run of 03:24)
$(SPARK_VERSIONS:%=test-spark-%): test-spark-%: .venv-spark%/.installed
	@echo "== Spark $* (.venv-spark$*): the Spark tests of the sink, the sources, the syphon job and dedupe"
	.venv-spark$*/bin/python -m pytest -q -n 2 --dist loadfile --durations=8 $(EVERY_SPARK) tests/spark

# The manual (docs/, mkdocs.yml) into site/, strict: a broken link, a page missing from the nav or a reference to
# a name that does not exist fails the build. Open site/index.html.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# mypy on spark_sb (pyproject.toml, [tool.mypy]: strict for the modules that hold public names)
typecheck: $(VENV)/.installed
	$(PY) -m mypy

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

bench: $(VENV)/.installed
	$(PY) bench/emulator_ingest.py
	$(PY) bench/latency.py

# the far-namespace and loopback rows of bench/latency.py and the CPU per message of bench/cpu.py, in a few minutes:
# every change to the send path (spark_sb/bus/, spark_sb/paired/, sink.py, writer.py, wire.py) puts these tables
# in its note beside the ones before it
bench-quick: $(VENV)/.installed
	$(PY) bench/latency.py --quick
	$(PY) bench/cpu.py --messages 3000

chaos: $(VENV)/.installed
	$(PY) bench/chaos.py

soak: $(VENV)/.installed
	$(PY) bench/soak.py $(SOAK_ARGS)

# a cluster's faults (issue 51): executors, workers and drivers killed on a standalone cluster (bench/cluster_soak.py)
soak-cluster: $(VENV)/.installed
	$(PY) bench/cluster_soak.py $(SOAK_ARGS)
