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

.PHONY: all kvhost plugins plugin-fake plugin-nixl plugin-mori test vet demo bench install dist clean

all: kvhost plugin-fake

kvhost:
	CGO_ENABLED=0 $(GO) build -trimpath -o $(BIN) ./cmd/kvhost

plugins: plugin-fake

plugin-fake: $(PLUGIN_DIR)/libkvhost_fake.so

$(PLUGIN_DIR)/libkvhost_fake.so: plugins/fake/fake.c $(COMMON_SRC) $(COMMON_HDR)
	@mkdir -p $(PLUGIN_DIR)
	$(CC) $(CFLAGS_PLUGIN) -Iabi -Iplugins/common -shared -o $@ plugins/fake/fake.c $(COMMON_SRC)

# --- C tests of the plugins' shared code and of the fake plugin -------------
# `make plugin-test` builds and runs them under AddressSanitizer+UBSan and,
# separately, ThreadSanitizer; it also checks that kvp_util compiles as C++17
# (the nixl and mori shims include it).
PLUGIN_TEST_DIR := build/plugintest
CFLAGS_PTEST := -std=c11 -O1 -g -Wall -Wextra -Werror -pthread -fno-omit-frame-pointer -Iabi -Iplugins/common
SAN_ASAN := -fsanitize=address,undefined -fno-sanitize-recover=all
SAN_TSAN := -fsanitize=thread

.PHONY: plugin-test plugin-test-util

plugin-test: plugin-test-util

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

plugin-nixl:
	@if [ -z "$(NIXL_PREFIX)" ]; then \
	  echo "plugin-nixl: set NIXL_PREFIX to an installed NIXL (headers in \$$NIXL_PREFIX/include, libraries in \$$NIXL_PREFIX/lib or lib/x86_64-linux-gnu), e.g. make plugin-nixl NIXL_PREFIX=/opt/nixl" >&2; \
	  exit 2; \
	fi
	@echo "plugin-nixl: not implemented yet" >&2; exit 2

plugin-mori:
	@if [ -z "$(MORI_PREFIX)" ]; then \
	  echo "plugin-mori: set MORI_PREFIX to an installed MORI-IO (headers in \$$MORI_PREFIX/include, libraries in \$$MORI_PREFIX/lib), e.g. make plugin-mori MORI_PREFIX=/opt/mori" >&2; \
	  exit 2; \
	fi
	@echo "plugin-mori: not implemented yet" >&2; exit 2

vet:
	$(GO) vet ./...

test: all vet
	$(GO) test -race -count=1 ./...

clean:
	rm -rf bin lib dist
