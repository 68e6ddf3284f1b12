// Package vllme2e holds the end-to-end tests of kvhost serve's vLLM
// (pull) side: test engine processes that own their KV in POSIX shared
// memory, each driving a sidecar over the control API
// (docs/engine-api.md), and interop with a vLLM-style peer that is not a
// sidecar (`kvhost prefill --style vllm`). Everything is in its tests.
package vllme2e
