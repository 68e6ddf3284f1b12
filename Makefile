# kvhost build. `make` builds the cgo-free binary and the fake plugin;
# `make test` runs everything CI runs.

GO       ?= go
CC       ?= gcc
CXX      ?= g++
PREFIX   ?= /usr/local
BIN      := bin/kvhost
PLUGIN_DIR := lib/kvhost
CFLAGS_PLUGIN ?= -std=c11 -O2 -g -fPIC -Wall -Wextra -Werror -pthread -fvisibility=hidden
CXXFLAGS_PLUGIN ?= -std=c++17 -O2 -g -fPIC -Wall -Wextra -Werror -pthread -fvisibility=hidden

COMMON_SRC := plugins/common/kvp_util.c
COMMON_HDR := plugins/common/kvp_util.h abi/kvplugin.h

.PHONY: all kvhost plugins plugin-fake plugin-nixl plugin-mori test vet lint demo demo-engine bench bench-engine install dist clean

all: kvhost plugin-fake

kvhost:
	CGO_ENABLED=0 $(GO) build -trimpath -o $(BIN) ./cmd/kvhost

plugins: plugin-fake

plugin-fake: $(PLUGIN_DIR)/libkvhost_fake.so

$(PLUGIN_DIR)/libkvhost_fake.so: plugins/fake/fake.c $(COMMON_SRC) $(COMMON_HDR)
	@mkdir -p $(PLUGIN_DIR)
	$(CC) $(CFLAGS_PLUGIN) -Iabi -Iplugins/common -shared -o $@ plugins/fake/fake.c $(COMMON_SRC)

# Test plugins (not installed): the fake plugin built to claim ABI major 2,
# which a host speaking ABI 1 must refuse and say so.
TESTPLUGIN_DIR := build/testplugins
.PHONY: plugin-fake-abi2
plugin-fake-abi2: $(TESTPLUGIN_DIR)/libkvhost_fakeabi2.so

$(TESTPLUGIN_DIR)/libkvhost_fakeabi2.so: plugins/fake/fake.c $(COMMON_SRC) $(COMMON_HDR)
	@mkdir -p $(TESTPLUGIN_DIR)
	$(CC) $(CFLAGS_PLUGIN) -DKVP_FAKE_ABI_MAJOR=2 -Iabi -Iplugins/common -shared -o $@ plugins/fake/fake.c $(COMMON_SRC)

# --- C tests of the plugins' shared code and of the fake plugin -------------
# `make plugin-test` builds and runs them under AddressSanitizer+UBSan and,
# separately, ThreadSanitizer; it also checks that kvp_util compiles as C++17
# (the nixl and mori shims include it).
PLUGIN_TEST_DIR := build/plugintest
CFLAGS_PTEST := -std=c11 -O1 -g -Wall -Wextra -Werror -pthread -fno-omit-frame-pointer -Iabi -Iplugins/common
SAN_ASAN := -fsanitize=address,undefined -fno-sanitize-recover=all
SAN_TSAN := -fsanitize=thread

.PHONY: plugin-test plugin-test-util plugin-test-fake plugin-bench

plugin-test: plugin-test-util plugin-test-fake

plugin-test-util: $(PLUGIN_TEST_DIR)/test_kvp_util_asan $(PLUGIN_TEST_DIR)/test_kvp_util_tsan $(PLUGIN_TEST_DIR)/kvp_util_cxx.o
	$(PLUGIN_TEST_DIR)/test_kvp_util_asan
	$(PLUGIN_TEST_DIR)/test_kvp_util_tsan

$(PLUGIN_TEST_DIR)/test_kvp_util_asan: plugins/common/test_kvp_util.c $(COMMON_SRC) $(COMMON_HDR)
	@mkdir -p $(PLUGIN_TEST_DIR)
	$(CC) $(CFLAGS_PTEST) $(SAN_ASAN) -o $@ plugins/common/test_kvp_util.c $(COMMON_SRC)

$(PLUGIN_TEST_DIR)/test_kvp_util_tsan: plugins/common/test_kvp_util.c $(COMMON_SRC) $(COMMON_HDR)
	@mkdir -p $(PLUGIN_TEST_DIR)
	$(CC) $(CFLAGS_PTEST) $(SAN_TSAN) -o $@ plugins/common/test_kvp_util.c $(COMMON_SRC)

$(PLUGIN_TEST_DIR)/kvp_util_cxx.o: $(COMMON_SRC) $(COMMON_HDR)
	@mkdir -p $(PLUGIN_TEST_DIR)
	$(CXX) -std=c++17 -Wall -Wextra -Werror -Wpedantic -Iabi -Iplugins/common -x c++ -c -o $@ $(COMMON_SRC)

# plugin-nixl builds the NIXL shim and the direct-NIXL baseline benchmark
# against an installed NIXL (see plugins/nixl/README.md). NIXL_LIBDIR is the
# first of $(NIXL_PREFIX)/lib/x86_64-linux-gnu and $(NIXL_PREFIX)/lib that
# holds libnixl.so; the plugin gets an rpath to it. KVP_NIXL_HAVE_STRIDE comes
# from a compile test: 1 when nixl.h has the strided list API.
NIXL_LIBDIR ?= $(firstword $(foreach d,$(NIXL_PREFIX)/lib/x86_64-linux-gnu $(NIXL_PREFIX)/lib,$(if $(wildcard $(d)/libnixl.so),$(d))))
NIXL_CXXFLAGS = $(CXXFLAGS_PLUGIN) -Iabi -Iplugins/common -isystem $(NIXL_PREFIX)/include
NIXL_LDFLAGS = -L$(NIXL_LIBDIR) -Wl,-rpath,$(NIXL_LIBDIR) -Wl,-z,defs -lnixl -lnixl_build -pthread
NIXL_STRIDE_TEST = printf '%s\n' '\#include <nixl.h>' \
  'nixl_status_t f(nixlAgent &a, nixlDlistH *&h) { nixl_stride_dlist_t l(DRAM_SEG);' \
  '  l.addDesc(nixlStrideDesc(0, 1, 0, 1, 1)); return a.prepXferDlist(NIXL_INIT_AGENT, l, h); }' \
  | $(CXX) $(NIXL_CXXFLAGS) -fsyntax-only -x c++ - >/dev/null 2>&1 && echo 1 || echo 0

FAKE_TEST_SRC := plugins/fake/test_fake.c plugins/fake/fake.c $(COMMON_SRC)
# The C tests build fake.c with its test hooks (see KVP_FAKE_TEST_HOOKS in
# fake.c); the plugin libraries never have them.
FAKE_TEST_FLAGS := -DKVP_FAKE_TEST_HOOKS
FAKE_TEST_DEPS := $(FAKE_TEST_SRC) $(COMMON_HDR)
FAKE_SO_ARGS := --so $(PLUGIN_DIR)/libkvhost_fake.so --so-abi2 $(TESTPLUGIN_DIR)/libkvhost_fakeabi2.so

# The fake plugin's C tests: under ASan+UBSan, under TSan, then optimised
# (which also prints the post+poll and 1 MiB vs memcpy timings).
plugin-test-fake: $(PLUGIN_TEST_DIR)/test_fake_asan $(PLUGIN_TEST_DIR)/test_fake_tsan $(PLUGIN_TEST_DIR)/test_fake_opt $(PLUGIN_DIR)/libkvhost_fake.so $(TESTPLUGIN_DIR)/libkvhost_fakeabi2.so
	$(PLUGIN_TEST_DIR)/test_fake_asan --no-bench $(FAKE_SO_ARGS)
	$(PLUGIN_TEST_DIR)/test_fake_tsan --no-bench
	$(PLUGIN_TEST_DIR)/test_fake_opt $(FAKE_SO_ARGS)

# Timing only; fails below 0.9x memcpy for a 1 MiB same-process transfer.
plugin-bench: $(PLUGIN_TEST_DIR)/test_fake_opt
	$(PLUGIN_TEST_DIR)/test_fake_opt --bench 0.9

$(PLUGIN_TEST_DIR)/test_fake_asan: $(FAKE_TEST_DEPS)
	@mkdir -p $(PLUGIN_TEST_DIR)
	$(CC) $(CFLAGS_PTEST) $(FAKE_TEST_FLAGS) $(SAN_ASAN) -o $@ $(FAKE_TEST_SRC) -ldl

$(PLUGIN_TEST_DIR)/test_fake_tsan: $(FAKE_TEST_DEPS)
	@mkdir -p $(PLUGIN_TEST_DIR)
	$(CC) $(CFLAGS_PTEST) $(FAKE_TEST_FLAGS) $(SAN_TSAN) -o $@ $(FAKE_TEST_SRC) -ldl

$(PLUGIN_TEST_DIR)/test_fake_opt: $(FAKE_TEST_DEPS)
	@mkdir -p $(PLUGIN_TEST_DIR)
	$(CC) $(subst -O1,-O2,$(CFLAGS_PTEST)) $(FAKE_TEST_FLAGS) -o $@ $(FAKE_TEST_SRC) -ldl

plugin-nixl:
	@if [ -z "$(NIXL_PREFIX)" ]; then \
	  echo "plugin-nixl: set NIXL_PREFIX to an installed NIXL (headers in \$$NIXL_PREFIX/include, libraries in \$$NIXL_PREFIX/lib or lib/x86_64-linux-gnu), e.g. make plugin-nixl NIXL_PREFIX=/opt/nixl" >&2; \
	  exit 2; \
	fi
	@if [ ! -f "$(NIXL_PREFIX)/include/nixl.h" ]; then \
	  echo "plugin-nixl: $(NIXL_PREFIX)/include/nixl.h not found: NIXL_PREFIX must be where NIXL was installed (meson --prefix)" >&2; exit 2; \
	fi
	@if [ -z "$(NIXL_LIBDIR)" ]; then \
	  echo "plugin-nixl: libnixl.so not found in $(NIXL_PREFIX)/lib/x86_64-linux-gnu or $(NIXL_PREFIX)/lib (set NIXL_LIBDIR)" >&2; exit 2; \
	fi
	@mkdir -p build/nixl
	@stride=$$($(NIXL_STRIDE_TEST)); echo "$(NIXL_PREFIX) $(NIXL_LIBDIR) $$stride" > build/nixl/config.new; \
	  cmp -s build/nixl/config.new build/nixl/config || mv build/nixl/config.new build/nixl/config; \
	  $(MAKE) --no-print-directory $(PLUGIN_DIR)/libkvhost_nixl.so bin/nixl-bench-direct \
	    NIXL_LIBDIR=$(NIXL_LIBDIR) KVP_NIXL_HAVE_STRIDE=$$stride

# build/nixl/config records the NIXL it was built against, so switching
# NIXL_PREFIX (or NIXL gaining the strided API) rebuilds.
$(PLUGIN_DIR)/libkvhost_nixl.so: plugins/nixl/nixl_plugin.cc $(COMMON_SRC) $(COMMON_HDR) build/nixl/config
	@mkdir -p $(PLUGIN_DIR)
	@echo "plugin-nixl: NIXL $(NIXL_PREFIX) (libs $(NIXL_LIBDIR)), strided list API: $(KVP_NIXL_HAVE_STRIDE)"
	$(CC) $(CFLAGS_PLUGIN) -Iabi -Iplugins/common -c -o build/nixl/kvp_util.o $(COMMON_SRC)
	$(CXX) $(NIXL_CXXFLAGS) -DKVP_NIXL_HAVE_STRIDE=$(KVP_NIXL_HAVE_STRIDE) -shared -o $@ \
	  plugins/nixl/nixl_plugin.cc build/nixl/kvp_util.o $(NIXL_LDFLAGS)

bin/nixl-bench-direct: plugins/nixl/bench_direct.cc abi/kvplugin.h build/nixl/config
	@mkdir -p bin
	$(CXX) $(filter-out -fvisibility=hidden,$(NIXL_CXXFLAGS)) -o $@ plugins/nixl/bench_direct.cc $(NIXL_LDFLAGS)

# plugin-mori builds the MORI-IO shim against an installed MORI (see
# plugins/mori/README.md). MORI_PREFIX is either a CMake install prefix
# (include/mori/io/io.hpp, lib/libmori_io.so) or the folder of the `mori`
# Python package (site-packages/mori: libmori_io.so, _jit-sources/include,
# _jit-sources/3rdparty). MORI's public IO headers also include msgpack-c,
# spdlog, HIP and libibverbs headers: MORI_DEP_INCLUDES lists the folders
# that hold them (default: the wheel's or MORI_SRC's 3rdparty copies and
# $(ROCM_PATH)/include; libibverbs-dev is expected in /usr/include);
# plugins/mori/missing_headers.sh names each family that is missing.
# plugins/mori/build_facts.sh finds the MORI commit (MORI_COMMIT, or
# MORI_SRC's git, or the wheel's version), how it registers memory
# (MORI_REG) and the build ID of libmori_io.so: the shim records them and
# refuses to run with another libmori_io.so.
# -std=c++20: MORI's rdma.hpp needs it under g++ (constexpr std::equal).
ROCM_PATH ?= /opt/rocm
MORI_INCDIR ?= $(firstword $(foreach d,$(MORI_PREFIX)/include $(MORI_PREFIX)/_jit-sources/include,$(if $(wildcard $(d)/mori/io/io.hpp),$(d))))
MORI_LIBDIR ?= $(firstword $(foreach d,$(MORI_PREFIX)/lib $(MORI_PREFIX)/lib64 $(MORI_PREFIX),$(if $(wildcard $(d)/libmori_io.so),$(d))))
MORI_3RDPARTY ?= $(firstword $(wildcard $(MORI_PREFIX)/_jit-sources/3rdparty $(if $(MORI_SRC),$(MORI_SRC)/3rdparty)))
MORI_DEP_INCLUDES ?= $(wildcard $(MORI_3RDPARTY)/msgpack-c/include $(MORI_3RDPARTY)/spdlog/include) $(ROCM_PATH)/include
MORI_CXXFLAGS = $(subst -std=c++17,-std=c++20,$(CXXFLAGS_PLUGIN)) -DMSGPACK_NO_BOOST -D__HIP_PLATFORM_AMD__ \
  -Iabi -Iplugins/common -isystem $(MORI_INCDIR) $(foreach d,$(MORI_DEP_INCLUDES),-isystem $(d))
MORI_LDFLAGS = -L$(MORI_LIBDIR) -Wl,-rpath,$(MORI_LIBDIR) -Wl,-rpath-link,$(ROCM_PATH)/lib \
  -Wl,-z,defs -lmori_io -libverbs -pthread

plugin-mori:
	@if [ -z "$(MORI_PREFIX)" ]; then \
	  echo "plugin-mori: set MORI_PREFIX to an installed MORI-IO: a CMake install prefix (headers in \$$MORI_PREFIX/include, libraries in \$$MORI_PREFIX/lib) or the mori Python package folder (site-packages/mori), e.g. make plugin-mori MORI_PREFIX=/opt/mori" >&2; \
	  exit 2; \
	fi
	@if [ -z "$(MORI_INCDIR)" ]; then \
	  echo "plugin-mori: mori/io/io.hpp not found in $(MORI_PREFIX)/include or $(MORI_PREFIX)/_jit-sources/include (set MORI_INCDIR)" >&2; exit 2; \
	fi
	@if [ -z "$(MORI_LIBDIR)" ]; then \
	  echo "plugin-mori: libmori_io.so not found in $(MORI_PREFIX)/lib, lib64 or $(MORI_PREFIX) (set MORI_LIBDIR)" >&2; exit 2; \
	fi
	@ROCM_PATH="$(ROCM_PATH)" plugins/mori/missing_headers.sh $(CXX) $(MORI_CXXFLAGS) || { \
	  echo "plugin-mori: set MORI_SRC (MORI's source tree), ROCM_PATH (now $(ROCM_PATH)) or MORI_DEP_INCLUDES" >&2; exit 2; }
	@facts=$$(MORI_SRC="$(MORI_SRC)" MORI_PREFIX="$(MORI_PREFIX)" MORI_COMMIT="$(MORI_COMMIT)" \
	  MORI_REG="$(MORI_REG)" plugins/mori/build_facts.sh $(MORI_LIBDIR)) || exit 2; \
	  mkdir -p build/mori && \
	  echo "$(MORI_INCDIR) $(MORI_LIBDIR) $(MORI_DEP_INCLUDES) $$facts" > build/mori/config.new && \
	  { cmp -s build/mori/config.new build/mori/config || mv build/mori/config.new build/mori/config; } && \
	  set -- $$facts && \
	  $(MAKE) --no-print-directory $(PLUGIN_DIR)/libkvhost_mori.so MORI_INCDIR=$(MORI_INCDIR) \
	    MORI_LIBDIR=$(MORI_LIBDIR) MORI_DEP_INCLUDES="$(MORI_DEP_INCLUDES)" \
	    MORI_FACTS="-DKVHOST_MORI_COMMIT='\"$$1\"' -DKVHOST_MORI_REG='\"$$2\"' -DKVHOST_MORI_LIB_ID='\"$$3\"'"

# Rebuilt when the MORI found (build/mori/config) or the sources change.
$(PLUGIN_DIR)/libkvhost_mori.so: plugins/mori/mori_plugin.cc build/mori/kvp_util.o build/mori/config $(COMMON_HDR)
	@mkdir -p $(PLUGIN_DIR)
	@echo "plugin-mori: MORI headers $(MORI_INCDIR), libmori_io.so in $(MORI_LIBDIR)"
	$(CXX) $(MORI_CXXFLAGS) $(MORI_FACTS) -shared -o $@ plugins/mori/mori_plugin.cc build/mori/kvp_util.o $(MORI_LDFLAGS)

# mori-stub-test builds the mori shim against the stand-in headers
# (plugins/mori/stubtest/include) with the stand-in libmori_io.so and
# libibverbs.so.1 and runs its stand-in test, under AddressSanitizer+UBSan
# and under ThreadSanitizer: every ABI entry, the bytes moved, and the
# refusals (another libmori_io.so, a grown IOEngine, the XGMI-only
# fallback, memory a NIC cannot register, also as built for MORI before
# 09ad89c4 and up to 0d05a4d2). It needs Debian's
# libmsgpack-cxx-dev and libibverbs-dev (headers only), which
# plugins/mori/stubtest/install-deps.sh installs when missing.
.PHONY: mori-stub-test
mori-stub-test:
	@plugins/mori/stubtest/install-deps.sh
	SAN="$(SAN_ASAN)" REG_MODES="ibv auto-offset0" plugins/mori/stubtest/run.sh build/mori-stub/asan plugins/mori/stubtest/include
	SAN="$(SAN_TSAN)" plugins/mori/stubtest/run.sh build/mori-stub/tsan plugins/mori/stubtest/include

build/mori/kvp_util.o: $(COMMON_SRC) $(COMMON_HDR)
	@mkdir -p build/mori
	$(CC) $(CFLAGS_PLUGIN) -Iabi -Iplugins/common -c -o $@ $(COMMON_SRC)

vet:
	$(GO) vet ./...

# lint runs staticcheck (a pinned version, fetched through the module proxy
# and built by `go run`, so a fresh machine with Go needs nothing else) and
# checks that go.mod and go.sum are tidy.
STATICCHECK_VERSION ?= v0.8.2
lint:
	$(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...
	$(GO) mod tidy -diff

# DEMO_ARGS changes the demo's scenario, e.g. make demo DEMO_ARGS="--style vllm".
DEMO_ARGS ?=

demo: all
	$(BIN) demo $(DEMO_ARGS)

bench: all
	$(BIN) bench $(BENCH_ARGS)

# demo-engine is the real integration: Python engines (KV pools in shared
# memory: sealed memfds, or POSIX shm objects with --pool shm) driving the
# kvhost.vllm and kvhost.sglang adapters, each engine
# beside its own `kvhost serve`, every byte verified in the engines' memory
# (python/kvhost/demo_engine.py). PYTHON (see python-test) needs pyzmq,
# msgpack and numpy (Debian: python3-zmq python3-msgpack python3-numpy), e.g.
# make demo-engine DEMO_ENGINE_ARGS="--styles vllm --baseline" (the default
# is --baseline). --baseline compares the pair's transfer rate with kvhost demo --in-process's on the
# same shape and the same definition (the time kvhost had a transfer in
# flight: the sidecars' kvhost_transfer_busy_seconds_total); --baseline-procs
# adds kvhost demo with its workers in separate processes. Each engine runs
# its stand-in GPU work (the prefill's fill, the decode's verify) on a
# "device" thread at SCHED_IDLE (--device-priority idle, the default): that
# work is the GPU's in a deployment, and on a machine with fewer cores than
# processes it would otherwise preempt the sidecars' copies, which real GPU
# kernels do not; --device-priority normal keeps it at the engine's
# priority, for comparison. The "sidecar CPU" line gives how long each
# kvhost serve's threads waited, runnable, for a core per second they ran
# over the pair's steady state (/proc schedstat), beside kvhost demo
# --in-process's own: where the sidecars' wait/run is well above the
# baseline's (more busy processes than cores), the pair's transfer rate is
# bounded by CPU availability, not by kvhost.
DEMO_ENGINE_ARGS ?= --baseline

demo-engine: all
	PYTHONPATH=$(CURDIR)/python $(PYTHON) -m kvhost.demo_engine --kvhost $(BIN) $(DEMO_ENGINE_ARGS)

# bench-engine measures what the adapters cost the engines' scheduler
# threads per request (SGLang prefill/decode, vLLM scheduler/worker) beside
# same-run baselines, and the client's round trip beside raw pyzmq's
# (python/kvhost/bench_engine.py). A benchmark, not a test: it prints the
# numbers and which goals of issue 24 they meet, e.g.
# make bench-engine BENCH_ENGINE_ARGS="--rounds 5 --detail".
BENCH_ENGINE_ARGS ?=

bench-engine: all
	PYTHONPATH=$(CURDIR)/python $(PYTHON) -m kvhost.bench_engine --kvhost $(BIN) $(BENCH_ENGINE_ARGS)

# test runs everything CI runs: vet, staticcheck and go mod tidy -diff
# (lint), the plugins' C tests under sanitizers (the mori shim's stand-in test among them),
# every Go test under the race detector, an install from a temporary prefix,
# and the end-to-end demo at CI scale in both styles (separate processes,
# every byte verified).
test: all vet lint plugin-fake-abi2 plugin-test mori-stub-test python-test
	$(GO) test -race -count=1 ./...
	$(GO) test -count=1 ./...
	$(MAKE) --no-print-directory install-check
	$(BIN) demo --requests 48 --layers 4
	$(BIN) demo --requests 48 --layers 4 --style vllm

# python-test runs the Python package's tests (python/tests) with Debian's
# python3-pytest against live `kvhost serve` sidecars of bin/kvhost.
PYTHON ?= /usr/bin/python3
PYTEST_ARGS ?=
.PHONY: python-test
python-test: all
	cd python && $(PYTHON) -m pytest -q $(PYTEST_ARGS) tests

# flake-check runs the whole Go suite repeatedly, the way a loaded machine
# shakes out tests that pass only sometimes: every package -count=20
# without the race detector (fast code exposes a race between a test and
# what it waits for), then -count=5 under it (slow code exposes timing
# assumptions). Not part of `make test` (it takes far longer); run it
# before submitting a change to tests. FLAKE_PKGS narrows it.
FLAKE_PKGS ?= ./...
FLAKE_COUNT ?= 20
FLAKE_RACE_COUNT ?= 5
.PHONY: flake-check
flake-check: all plugin-fake-abi2
	@start=$$(date +%s); rc=0; \
	  $(GO) test -count=$(FLAKE_COUNT) -timeout 60m $(FLAKE_PKGS) || rc=1; \
	  $(GO) test -race -count=$(FLAKE_RACE_COUNT) -timeout 60m $(FLAKE_PKGS) || rc=1; \
	  t=$$(( $$(date +%s) - start )); \
	  if [ $$rc = 0 ]; then echo "flake-check: ok in $$t s"; else echo "flake-check: FAILED after $$t s" >&2; fi; \
	  exit $$rc

clean:
	rm -rf bin lib dist build

# --- install and dist ---------------------------------------------------------
# `make install PREFIX=/opt/kvhost` puts bin/kvhost and every plugin built
# (lib/kvhost/libkvhost_*.so) under PREFIX (DESTDIR is prepended, for
# packaging). The binary finds its plugins in ../lib/kvhost beside itself,
# so nothing needs KVHOST_PLUGIN_PATH. Build the nixl or mori plugin first
# (make plugin-nixl NIXL_PREFIX=...) to install it too.
# `make dist` makes dist/kvhost-VERSION-OS-ARCH.tar.gz holding the same tree
# (plus README.md) under kvhost-VERSION-OS-ARCH/; VERSION defaults to
# `git describe`.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
DIST_OS := $(shell $(GO) env GOOS)
DIST_ARCH := $(shell $(GO) env GOARCH)
DIST_NAME = kvhost-$(VERSION)-$(DIST_OS)-$(DIST_ARCH)

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib/kvhost
	install -m 0755 $(BIN) $(DESTDIR)$(PREFIX)/bin/kvhost
	install -m 0644 $(PLUGIN_DIR)/libkvhost_*.so $(DESTDIR)$(PREFIX)/lib/kvhost/
	@echo "installed $(DESTDIR)$(PREFIX)/bin/kvhost and" $$(cd $(PLUGIN_DIR) && ls libkvhost_*.so)

dist: all
	rm -rf dist/$(DIST_NAME) dist/$(DIST_NAME).tar.gz
	$(MAKE) --no-print-directory install DESTDIR= PREFIX=$(CURDIR)/dist/$(DIST_NAME)
	install -m 0644 README.md dist/$(DIST_NAME)/
	tar -C dist --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -czf dist/$(DIST_NAME).tar.gz $(DIST_NAME)
	@echo dist/$(DIST_NAME).tar.gz

# install-check installs into a temporary PREFIX and checks, from outside
# the checkout and without KVHOST_PLUGIN_PATH, that the installed binary
# finds and loads its installed plugins and moves verified bytes through
# them (kvhost bench, one short row per process layout).
.PHONY: install-check
install-check:
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  $(MAKE) --no-print-directory install DESTDIR= PREFIX=$$tmp/prefix >/dev/null && \
	  cd / && env -u KVHOST_PLUGIN_PATH $$tmp/prefix/bin/kvhost plugins --json > $$tmp/plugins.json && \
	  grep -q "\"file\": \"$$tmp/prefix/lib/kvhost/libkvhost_fake.so\"" $$tmp/plugins.json || \
	    { echo "install-check: the installed kvhost does not list its installed fake plugin:" >&2; cat $$tmp/plugins.json >&2; exit 1; } && \
	  env -u KVHOST_PLUGIN_PATH $$tmp/prefix/bin/kvhost bench --procs 1,2 --blocks 64K --rounds 1 --iters 2 --time 1ms --csv > $$tmp/bench.csv && \
	  test "$$(grep -c ',true,' $$tmp/bench.csv)" = 2 || { echo "install-check: bench through the installed plugin failed:" >&2; cat $$tmp/bench.csv >&2; exit 1; } && \
	  echo "install-check: ok (plugins found in $$tmp/prefix/lib/kvhost, bytes verified in one and two processes)"
