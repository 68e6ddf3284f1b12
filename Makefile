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
