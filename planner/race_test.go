//go:build race

package planner

// raceEnabled: the race detector slows single-threaded planning about
// tenfold; the heaviest tests plan fewer cases under it (races are what a
// -race run is for, and every case still runs without it).
const raceEnabled = true
