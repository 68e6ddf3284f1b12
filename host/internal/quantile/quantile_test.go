package quantile

import (
	"math"
	"reflect"
	"testing"
)

func TestPercentile(t *testing.T) {
	for _, c := range []struct {
		v    []float64
		q    float64
		want float64
	}{
		{nil, 90, 0},
		{[]float64{5}, 90, 5},
		{[]float64{3, 1, 2}, 50, 2},
		{[]float64{1, 2, 3, 4}, 99, 3.97},
		{[]float64{4, 3, 2, 1}, 0, 1},
		{[]float64{4, 3, 2, 1}, 100, 4},
	} {
		in := append([]float64(nil), c.v...)
		if got := Percentile(c.v, c.q); math.Abs(got-c.want) > 1e-12 {
			t.Errorf("Percentile(%v, %v) = %v, want %v", c.v, c.q, got, c.want)
		}
		if !reflect.DeepEqual(in, c.v) {
			t.Errorf("Percentile sorted its input")
		}
	}
}

func TestNearestRank(t *testing.T) {
	for _, c := range []struct {
		v    []int64
		q    float64
		want int64
	}{
		{nil, 0.5, 0},
		{[]int64{7}, 0.99, 7},
		{[]int64{3, 1, 2}, 0.5, 2},
		{[]int64{4, 3, 2, 1}, 0.5, 3}, // round(0.5*3) = round(1.5) = 2: index 2 of 1,2,3,4
		{[]int64{1, 2, 3, 4}, 0, 1},
		{[]int64{1, 2, 3, 4}, 1, 4},
		{[]int64{10, 20, 30, 40, 50, 60, 70, 80, 90, 100}, 0.99, 100},
	} {
		if got := NearestRank(append([]int64(nil), c.v...), c.q); got != c.want {
			t.Errorf("NearestRank(%v, %v) = %v, want %v", c.v, c.q, got, c.want)
		}
	}
}

func TestMedian(t *testing.T) {
	for _, c := range []struct {
		v    []float64
		want float64
	}{
		{nil, 0},
		{[]float64{2}, 2},
		{[]float64{3, 1, 2}, 2},
		{[]float64{4, 1, 3, 2}, 2.5},
	} {
		in := append([]float64(nil), c.v...)
		if got := Median(c.v); got != c.want {
			t.Errorf("Median(%v) = %v, want %v", c.v, got, c.want)
		}
		if !reflect.DeepEqual(in, c.v) {
			t.Errorf("Median sorted its input")
		}
	}
}
