package memfdtest

// sysMemfdCreate is memfd_create's system call number (package syscall
// predates it).
const sysMemfdCreate = 319
