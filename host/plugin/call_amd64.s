//go:build amd64 && !kvhost_purego

#include "textflag.h"

// The address of callTrampoline, for runtime.cgocall (see call_amd64.go).
GLOBL ·callTrampolineABI0(SB), NOPTR|RODATA, $8
DATA ·callTrampolineABI0(SB)/8, $callTrampoline(SB)

// callTrampoline runs on the g0 stack, called by runtime.asmcgocall with
// the System V ABI: DI points to a cFrame {fn, arg, ret}. It calls
// fn(arg) and stores fn's result in ret. asmcgocall aligned the stack to
// 16 bytes before calling us; pushing BX (callee-saved, so fn keeps it)
// restores that alignment for our own CALL.
TEXT callTrampoline(SB), NOSPLIT|NOFRAME, $0
	PUSHQ BX
	MOVQ  DI, BX
	MOVQ  8(BX), DI
	MOVQ  0(BX), AX
	CALL  AX
	MOVQ  AX, 16(BX)
	POPQ  BX
	RET
