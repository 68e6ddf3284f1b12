package schedstat

import "syscall"

func gettid() int { return syscall.Gettid() }
