// Package planjson is the JSON request and response layer of `kvhost plan`:
// an envelope naming the style (sglang-nixl, sglang-mori, vllm) and kind
// (kv, aux, state, dsa_tail) of a request, one handler per (style, kind)
// that decodes the request strictly (errors name the offending JSON field)
// and calls the planning core in package planner, and the response writer
// (a summary, or every block the plan moves). The planning core knows
// nothing of JSON; this package knows nothing of planning beyond calling it.
package planjson
