//go:build !race

package push_test

const raceEnabled = false
