# Thin wrapper over CMake: `make run` and `make check` are what a new user types.
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=

.PHONY: all bootstrap build run check check-normal check-asan check-tsan bench clean

all: build

bootstrap:
	@scripts/bootstrap

build: bootstrap
	@cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS) >/dev/null
	@cmake --build build -j $(JOBS)

# The main job on the CPU backend: MoE layers with experts streamed from host memory.
run: build
	./build/tools/tandem moe --preset tiny --device cpu:0

# Every test: the normal build, then ASan+UBSan, then TSan.
check: check-normal check-asan check-tsan

check-normal: build
	cd build && ctest --output-on-failure -j $(JOBS)

check-asan: bootstrap
	@cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DTANDEM_SANITIZE=address $(CMAKE_FLAGS) >/dev/null
	@cmake --build build-asan -j $(JOBS)
	cd build-asan && ctest --output-on-failure -j $(JOBS) -LE nosan

check-tsan: bootstrap
	@cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DTANDEM_SANITIZE=thread $(CMAKE_FLAGS) >/dev/null
	@cmake --build build-tsan -j $(JOBS)
	cd build-tsan && TSAN_OPTIONS="suppressions=$(CURDIR)/tests/tsan.supp $(TSAN_OPTIONS)" \
	  ctest --output-on-failure -j $(JOBS) -LE nosan

bench: build
	./build/bench/bench-runtime --json bench/results/runtime-cpu.json

clean:
	rm -rf build build-asan build-tsan
