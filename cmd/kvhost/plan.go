package main

import (
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/urfave/cli/v2"

	"github.com/kvhost/kvhost/planner/planjson"
)

// maxPlanRequest bounds the request read from stdin or --in: page lists of
// a few million indices fit easily; anything larger is a mistake.
const maxPlanRequest = 256 << 20

func init() { register(planCommand) }

// planCommand builds `kvhost plan`.
func planCommand() *cli.Command {
	return &cli.Command{
		Name:      "plan",
		Usage:     "print the transfer plan of one KV, aux or state request (JSON in, JSON out)",
		UsageText: "kvhost plan [--in FILE] [--summary] < request.json",
		Description: "Reads one plan request (see docs/plan.md) from stdin or --in and prints which bytes\n" +
			"move where: the upstream code path chosen, descriptor counts, bytes and every copy as\n" +
			"[prefill_addr, decode_addr, len]. Nothing is transferred.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "in", EnvVars: env("PLAN_IN"), Usage: "read the request from `FILE` instead of stdin"},
			&cli.BoolFlag{Name: "summary", EnvVars: env("PLAN_SUMMARY"), Usage: "print everything but the copies"},
		},
		Action: runPlan,
	}
}

func runPlan(c *cli.Context) error {
	if c.NArg() > 0 {
		return fmt.Errorf("plan: unexpected argument %q (the request is read from stdin or --in)", c.Args().First())
	}
	in := c.App.Reader
	if name := c.String("in"); name != "" {
		f, err := os.Open(name)
		if err != nil {
			return fmt.Errorf("plan: --in: %w", err)
		}
		defer f.Close()
		in = f
	}
	raw, err := io.ReadAll(io.LimitReader(in, maxPlanRequest+1))
	if err != nil {
		return fmt.Errorf("plan: reading request: %w", err)
	}
	if len(raw) > maxPlanRequest {
		return errors.New("plan: request: larger than 256 MiB")
	}
	p, env, err := planjson.PlanRequest(raw)
	if err != nil {
		return fmt.Errorf("plan: %w", err)
	}
	return planjson.WriteResponse(c.App.Writer, env, p, c.Bool("summary"))
}
