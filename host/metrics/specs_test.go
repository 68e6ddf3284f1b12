package metrics

import (
	"reflect"
	"testing"
)

// TestNIXLSpecs: vLLM's names, kinds and buckets.
func TestNIXLSpecs(t *testing.T) {
	specs := NIXLSpecs()
	byName := map[string]Spec{}
	for _, s := range specs {
		byName[s.Name] = s
		if s.Reference != "vllm:"+s.Name {
			t.Errorf("%s: reference name %s", s.Name, s.Reference)
		}
	}
	times := []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0}
	want := map[string][]float64{
		"nixl_xfer_time_seconds": times[1:],
		"nixl_post_time_seconds": times,
		"nixl_bytes_transferred": {2048, 8192, 32768, 131072, 524288, 2097152, 8388608, 33554432, 134217728, 536870912,
			2147483648, 8589934592},
		"nixl_num_descriptors":          {10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000},
		"nixl_num_failed_transfers":     nil,
		"nixl_num_failed_notifications": nil,
	}
	if len(specs) != len(want) {
		t.Fatalf("%d specs", len(specs))
	}
	for name, buckets := range want {
		s, ok := byName[name]
		if !ok {
			t.Fatalf("no %s", name)
		}
		if (buckets == nil) != (s.Kind == Counter) || !reflect.DeepEqual(s.Buckets, buckets) {
			t.Errorf("%s: %s %v", name, s.Kind, s.Buckets)
		}
	}
	specs[0].Buckets[0] = 99
	if NIXLSpecs()[0].Buckets[0] == 99 {
		t.Fatal("NIXLSpecs shares its slices")
	}
}
