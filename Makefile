# Curvature Lab — build, test and run the book.
#   make book   install what is missing, build the whole book (profile: $CURVLAB_PROFILE, default standard)
#   make test   install what is missing, run the unit tests, build the whole book in the quick profile, strictly
#   make lab    open the chapters in JupyterLab (jupyterlab-myst) over a workspace copy: the repository is never written
#   make colab  regenerate notebooks/colab/, the chapters as Colab and JupyterLab open them (tools/colab.py)
# Everything is installed into ./.venv, a virtual environment that sees the system's site-packages, so a torch
# that is already installed (a CUDA build, say) is used as it is and never replaced.

PYTHON_SYS ?= python3
VENV       ?= .venv
PY         := $(VENV)/bin/python
PROFILE    ?= $(or $(CURVLAB_PROFILE),standard)
JOBS       ?= 2
STAMP      := $(VENV)/.curvlab-installed
TORCH_PIN  ?= torch==2.13.0

.PHONY: env book book-quick test unit built-tests lab colab bench clean clean-cache strip slides student pdf sweeps nbgrader

env: $(STAMP)

$(STAMP): lib/pyproject.toml tools/setup_env.py
	@test -x $(PY) || $(PYTHON_SYS) -m venv --system-site-packages $(VENV)
	$(PY) tools/setup_env.py --torch-pin "$(TORCH_PIN)"
	@touch $(STAMP)

book: env
	CURVLAB_PROFILE=$(PROFILE) $(PY) tools/build_book.py --jobs $(JOBS)

book-quick: env
	CURVLAB_PROFILE=quick $(PY) tools/build_book.py --jobs $(JOBS) --strict --force

unit: env
	$(PY) -m pytest tests -m "not built" -q

built-tests: env
	$(PY) -m pytest tests -m built -q

test: env
	$(MAKE) unit
	$(MAKE) book-quick
	$(MAKE) built-tests

lab: env
	$(PY) tools/colab.py --lab $(if $(PORT),--port $(PORT))

colab: env
	$(PY) tools/colab.py

# Every benchmark, then book/performance.md's cost-vs-size section (benchmarks/run_all.py).
bench: env
	$(PY) benchmarks/run_all.py

# Paper-scale grids (curvlab.paper_runs) into the sweep cache, outside the book build:
#   make sweeps PROFILE=paper [ONLY=ch21_regimes] [BACKEND=dask]
sweeps: env
	CURVLAB_PROFILE=$(PROFILE) $(PY) tools/run_sweeps.py --profile $(PROFILE) $(if $(ONLY),--only $(ONLY)) $(if $(BACKEND),--backend $(BACKEND))

strip: env
	$(PY) tools/nbtool.py normalize notebooks/*.ipynb

# Lecture kit (book/lecture_kit.md): offline reveal.js decks, student notebooks, the XeLaTeX handout.
slides: env
	CURVLAB_PROFILE=$(PROFILE) $(PY) tools/slides.py --jobs $(JOBS) $(if $(OUTPUTS),--outputs $(OUTPUTS))

student: env
	$(PY) tools/student.py

# Graded assignments: an nbgrader course folder in _build/nbgrader (book/lecture_kit.md, "Graded assignments").
nbgrader: env
	$(PY) tools/nbgrader_export.py $(CHAPTERS)

pdf: env
	@command -v xelatex >/dev/null && command -v latexmk >/dev/null || bash tools/install_tex.sh
	CURVLAB_PROFILE=$(PROFILE) $(PY) tools/pdf.py --jobs $(JOBS)

clean:
	rm -rf _build

clean-cache:
	rm -rf _build/.jupyter_cache _build/ledger .curvlab_cache
