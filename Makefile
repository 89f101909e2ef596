# One command per job. `make demo` and `make test` create the virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is pinned here (not in pyproject) so CPU-only machines get the CPU build from a local/CPU index;
# GPU users get the CUDA build of the same version from PyPI.
TORCH  ?= torch==2.13.0
# llama-cpp-python (test extra) builds llama.cpp from source: only the library, without curl (no hub downloads).
export CMAKE_ARGS ?= -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=OFF
PLAYS  := examples/data/shakespeare

.PHONY: venv demo lint test test-unit test-quick test-all docs clean
venv: $(BIN)/.installed
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

# Tokenizer -> packed data -> tiny Llama pretraining on CPU -> sample generation. Scratch lives in demo/.
demo: venv
	rm -rf demo
	$(BIN)/fitlm data tokenizer $(PLAYS)/*.txt --vocab-size 2048 --out demo/tokenizer.json
	$(BIN)/fitlm data pack $(PLAYS)/hamlet_gut.txt $(PLAYS)/macbeth_gut.txt $(PLAYS)/tempest_gut.txt \
		$(PLAYS)/romeo_and_juliet_gut.txt --tokenizer demo/tokenizer.json --out demo/data/train
	$(BIN)/fitlm data pack $(PLAYS)/lear_gut.txt --tokenizer demo/tokenizer.json --out demo/data/valid
	$(BIN)/fitlm train configs/tiny.yaml
	$(BIN)/fitlm generate demo/run --prompt "KING LEAR." --max-new-tokens 80 --temperature 0.8 --top-p 0.9

# The test command CI runs: the whole suite, slow tier included (unit, multi-process gloo, end-to-end CLI runs with
# golden losses, every parallel layout tied and untied, parity against transformers/PEFT/TRL). Two pytest workers:
# much of a test is waiting (process start-up, gloo), so two keep both cores busy; --dist loadfile keeps a
# module on one worker, so its module-scoped runs (shared torchrun worlds, measured profiles) happen once.
test: lint
	$(BIN)/python -m pytest -q --runslow -n 2 --dist loadfile

# Static checks, the first part of `make test`: ruff's lint (pyflakes, pycodestyle, import order, bugbear) and its
# formatter, then mypy's type check of fitlm/, all configured in pyproject.toml.
lint: venv
	$(BIN)/ruff check fitlm tests bench
	$(BIN)/ruff format --check fitlm tests bench
	$(BIN)/mypy fitlm

# The inner loop: tests/unit without the tests marked slow or process (no process started, nothing trained
# for more than a moment); under 2 minutes on 2 cores.
test-unit: venv
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests/unit -m "not process"

# The quick loop: the whole suite without the tests marked slow.
test-quick: venv
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# Alias of `make test`.
test-all: test

# Regenerate the generated tables: README's model families (registry), docs/config.md's config reference
# (schema docstrings) and refused combinations (fitlm/rules.py).
docs: venv
	$(BIN)/python -m fitlm.docs README.md docs/config.md

clean:
	rm -rf $(VENV) demo runs .pytest_cache
