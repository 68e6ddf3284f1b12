package serve

import "testing"

func testEndpoint(t testing.TB) string { return "tcp://127.0.0.1:0" }
