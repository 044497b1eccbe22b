# hvd_qsgd: `make demo` (the main job) and `make test` (the whole suite) both set up what they need.
PY := .venv/bin/python
NP ?= 4
# Open MPI refuses to run as root without these; TensorFlow's start-up chatter is silenced.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export TF_CPP_MIN_LOG_LEVEL := 2
export PYTHONUNBUFFERED := 1

.PHONY: setup setup-plan check-newest test test-quick demo bench fuzz gpu-check gpu-check-horovod gpu-carry gpu-session clean

# TORCH_VERSION=... / TF_VERSION=... override the pins of scripts/versions.sh; TORCH_INDEX_URL picks
# torch's index (https://download.pytorch.org/whl/cpu: the CPU build); CUDA_HOME the toolkit
setup:
	bash scripts/setup.sh

# what `make setup` would do on this machine (which torch, CUDA toolkit, NCCL, Horovod wheel), nothing done
setup-plan:
	bash scripts/setup.sh --plan

# opt-in, not part of `make test`: the newest torch from the registry in an environment of its own
# (~/.cache/hvd_qsgd/newest), Horovod built against it, the PyTorch tests run there; downloads 0.5-3 GB
check-newest:
	nice -n 10 bash scripts/check_newest.sh

test: setup
	$(PY) -m pytest -q -rs --durations=25 tests

# the suite without the multi-rank jobs, the slow tests and the GPU tests (tests/conftest.py marks them)
test-quick: setup
	$(PY) -m pytest -q -rs -m "not multirank and not slow and not gpu" tests

demo: setup
	bash scripts/demo.sh $(NP)

bench: setup
	$(PY) -m benchmarks kernels

# opt-in, not part of `make test` (which replays what this keeps): coverage-guided fuzzing of the
# codec's C ABI, CPU and emulated CUDA, under ASan and UBSan, FUZZ_S seconds (default 600) on each of
# the cores but one; needs clang (scripts/fuzz.sh). What covers more goes into tests/fuzz/corpus.pack
FUZZ_S ?= 600
fuzz: setup
	bash scripts/fuzz.sh search $(FUZZ_S)

# on a GPU machine (nvcc, compute-sanitizer, a CUDA build of torch): build, test, sanitize and time the
# CUDA kernels; the summary and logs go to $$OUT (default gpu_check_out/)
gpu-check:
	bash scripts/gpu_check.sh

# the second stage, on the same machine: Horovod (PyTorch + Gloo) built there from the carried source
# distribution, and the adapter's CUDA path against its host path on 2 ranks (docs/gpu.md)
gpu-check-horovod:
	bash scripts/gpu_check_horovod.sh

# where there is network: what gpu-check-horovod needs to carry (.gpu_carry/, ignored by git): Horovod's
# sdist, and the cffi wheels its PyTorch build needs, which the GPU machine's Python (3.12) lacks
gpu-carry:
	mkdir -p .gpu_carry
	python3 -m pip download -q --no-deps --no-binary :all: -d .gpu_carry horovod==$$(. scripts/versions.sh; echo $$HOROVOD_VERSION)
	python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .gpu_carry cffi pycparser

# on the GPU machine, in one call: gpu-check, gpu-check-horovod and the training run (docs/gpu.md)
gpu-session:
	bash scripts/gpu_session.sh

clean:
	rm -rf build *.egg-info hvd_qsgd/*.so hvd_qsgd/tensorflow/*.so hvd_qsgd/_build_target.json .pytest_cache
