//go:build race

package plugin

// raceEnabled: the race detector's instrumentation allocates, so allocation
// counts are only asserted without it.
const raceEnabled = true
