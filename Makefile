# Two commands do all the set-up on a machine with only Python 3 (>= 3.10):
#   make example    # .venv, torch (CPU, pinned), the package + extras; then train the small GPT
#   make test       # the same set-up; then python -m pytest -q -n auto ... (the docs build is one of the tests)
# Each target is `python3 tools/bootstrap.py <target>`: use that where make is missing.
# Extra arguments for the command: make example ARGS="--steps 100".

PYTHON ?= python3
ARGS ?=

.PHONY: setup example hf-example test docs clean

setup:
	$(PYTHON) tools/bootstrap.py setup

example:
	$(PYTHON) tools/bootstrap.py example $(ARGS)

hf-example:
	$(PYTHON) tools/bootstrap.py hf-example $(ARGS)

test:
	$(PYTHON) tools/bootstrap.py test $(ARGS)

docs:
	$(PYTHON) tools/bootstrap.py docs $(ARGS)

# Removes what the targets made (the virtual environment, the docs site, example outputs).
clean:
	rm -rf .venv site results
