# Thin wrapper over CMake: `make run` and `make check` are what a new user types.
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=
# The Python package's test environment (made by scripts/bootstrap) and its build folder.
VENV ?= build-venv
PYBUILD ?= build-python
PY := $(VENV)/bin/python

.PHONY: all bootstrap build run check check-normal check-python check-asan check-tsan bench \
        bench-python clean

all: build

bootstrap:
	@scripts/bootstrap

build: bootstrap
	@cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS) >/dev/null
	@cmake --build build -j $(JOBS)

# The main job on the CPU backend: a whole model from its GGUF file, its experts streamed from
# host memory: a small Qwen3-MoE (8 layers of 32 experts, random weights) written once by
# tests/model/tiny.py, a prompt of 128 ids, then 32 tokens decoded greedily.
RUN_MODEL := build/run-model/model.gguf
run: build $(RUN_MODEL)
	./build/tools/tandem run -m $(RUN_MODEL) -p 128 -n 32 --device cpu:0

$(RUN_MODEL): tests/model/tiny.py | bootstrap
	$(PY) tests/model/tiny.py --arch qwen3moe --out build/run-model --layers 8 --hidden 256 \
	  --heads 8 --kv-heads 2 --head-dim 32 --experts 32 --top-k 4 --moe-ffn 128 --vocab 4096 \
	  --ctx 1024 --seed 1 >/dev/null

# Every test: the normal build, the Python package, then ASan+UBSan, then TSan.
check: check-normal check-python check-asan check-tsan

check-normal: build
	cd build && ctest --output-on-failure -j $(JOBS)

# The Python package, installed into the test environment by scikit-build-core (an incremental
# build in $(PYBUILD)/), then its pytest suite on cpu:0 and opencl:0 (PoCL's pthread driver),
# the OpenCL tests again under PoCL's basic driver, and the Python examples.
check-python: bootstrap
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
	  --config-settings=build-dir=$(PYBUILD) .
	$(PY) -m pytest -q python/tests
	POCL_DEVICES=basic $(PY) -m pytest -q python/tests -k opencl
	$(PY) examples/python/pipeline_cpu.py
	$(PY) examples/python/pyopencl_interop.py
	$(PY) examples/python/order_manager_cupy.py
	$(PY) examples/python/offload_qwen3_moe.py

check-asan: bootstrap
	@cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DTANDEM_SANITIZE=address $(CMAKE_FLAGS) >/dev/null
	@cmake --build build-asan -j $(JOBS)
	cd build-asan && LSAN_OPTIONS="suppressions=$(CURDIR)/tests/lsan.supp $(LSAN_OPTIONS)" \
	  ctest --output-on-failure -j $(JOBS) -LE nosan

check-tsan: bootstrap
	@cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DTANDEM_SANITIZE=thread $(CMAKE_FLAGS) >/dev/null
	@cmake --build build-tsan -j $(JOBS)
	cd build-tsan && TSAN_OPTIONS="suppressions=$(CURDIR)/tests/tsan.supp $(TSAN_OPTIONS)" \
	  ctest --output-on-failure -j $(JOBS) -LE nosan

bench: build
	./build/bench/bench-runtime --json bench/results/runtime-cpu.json

# Per-call cost of the Python API on cpu:0 (against CuPy where a GPU and CuPy are present).
bench-python: check-python
	$(PY) bench/python_overhead.py --device cpu:0 --json bench/results/python-cpu.json

clean:
	rm -rf build build-asan build-tsan $(PYBUILD)
