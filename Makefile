# Strata: `make demo` and `make test` work on a fresh machine with only Rust installed.
SHELL := /bin/bash
CARGO ?= cargo
DEMO_MODEL ?= target/demo-model
STRATA_RELEASE := target/release/strata

.PHONY: test demo build lint fmt bench-engine prerequisites image image-cuda

## Everything CI checks: formatting, the crate map (which crate may link which), lints, the whole test suite (the CPU kernels and the
## HF comparisons again with the AVX2 and portable kernels), with and without the `cuda`
## feature (cudarc, loaded at run time, so it builds on a machine without CUDA): the CUDA
## kernels compile with NVRTC (no GPU needed) and run on the CPU emulator.
## The workspace is built once, with the CUDA features, and every test runs on that build:
## the CPU paths are the same code either way (only `--device cuda` differs: the driver is
## opened instead of refused), and a second build without the features would cost minutes.
## The build without them is checked by clippy (type checks and lints of the stubs).
## A full run builds every target from scratch: incremental caches (as large again as the
## build itself) would only fill the disk. The kernel reruns select tests across the
## workspace with the same features (not `-p`), so they reuse the build; an AMX host also
## reruns them capped at avx512 (its vector kernels for many rows). The tiles rerun
## runs the AMX paths on a software model of the tiles where the CPU has none.
CUDA_FEATURES := strata-cli/cuda,strata-engine/cuda-emulator
test: export CARGO_INCREMENTAL ?= 0
test: prerequisites
	$(CARGO) fmt --all -- --check
	scripts/check_crate_map.sh
	$(CARGO) build --workspace --all-targets --features $(CUDA_FEATURES)
	LD_LIBRARY_PATH="$$(scripts/nvrtc_lib_dir.sh)" $(CARGO) test --workspace --features $(CUDA_FEATURES)
	levels="avx2 portable"; grep -qw amx_tile /proc/cpuinfo 2>/dev/null && levels="avx512 $$levels"; \
	for k in $$levels; do STRATA_CPU_KERNELS=$$k $(CARGO) test --workspace --features $(CUDA_FEATURES) --lib backend::cpu \
		&& STRATA_CPU_KERNELS=$$k $(CARGO) test --workspace --features $(CUDA_FEATURES) --test engine hf_reference:: || exit 1; done
	STRATA_CPU_TILES=model $(CARGO) test --workspace --features $(CUDA_FEATURES) --lib backend::cpu \
		&& STRATA_CPU_TILES=model $(CARGO) test --workspace --features $(CUDA_FEATURES) --test engine hf_reference::
	$(CARGO) clippy --workspace --all-targets --features $(CUDA_FEATURES) -- -D warnings
	$(CARGO) clippy --workspace --all-targets -- -D warnings

## Installs what the build and tests need and is missing.
prerequisites:
	@scripts/prerequisites.sh

build:
	$(CARGO) build --workspace --bins

fmt:
	$(CARGO) fmt --all

## Builds in release, writes a small random model if none is given, streams generations.
demo: prerequisites
	$(CARGO) build --release --bin strata
	@if [ ! -f "$(DEMO_MODEL)/config.json" ]; then \
		$(STRATA_RELEASE) model random --arch llama --layers 4 --hidden 256 --heads 8 --kv-heads 4 \
			--intermediate 768 --vocab 2048 --out $(DEMO_MODEL); fi
	@scripts/demo.sh $(STRATA_RELEASE) $(DEMO_MODEL)

## Container images (needs docker): CPU, and CUDA for GPU nodes. IMAGE names them.
IMAGE ?= strata
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
image:
	docker build -f deploy/docker/Dockerfile -t $(IMAGE):$(VERSION) .
image-cuda:
	docker build -f deploy/docker/Dockerfile.cuda -t $(IMAGE):$(VERSION)-cuda .

## Engine benchmark on the Llama-3.2-1B shape against HF transformers (see docs/PERFORMANCE.md).
bench-engine:
	$(CARGO) build --release --bin strata
	scripts/bench_engine.sh
