// A stand-in libcudart for host/serve/engmem's tests: CI has no GPU. It
// exports the CUDA runtime entry points the sidecar calls, with CUDA's
// signatures (cuda_runtime_api.h) and error numbers and messages
// (driver_types.h), over POSIX shared memory: "device memory" is a file
// under /dev/shm, and a cudaIpcMemHandle_t names it.
//
// Handle layout (64 bytes, this stand-in's own; a real handle is opaque):
//   [0, 4)   magic "KVSI"
//   [4, 8)   int32 device the allocation lives on
//   [8, 56)  shm file name under /dev/shm, NUL-terminated
//   [56, 64) uint64 allocation size
//
// Stricter than CUDA where that catches host bugs:
//   - cudaIpcOpenMemHandle requires the calling THREAD's current device
//     (cudaSetDevice on that thread) to be the handle's device, so a
//     cudaSetDevice and an open on different OS threads fail;
//   - flags must be cudaIpcMemLazyEnablePeerAccess (1), which also checks
//     that the 64-byte handle passed by value did not displace the next
//     argument.
// Looser: a process may open its own handles (CUDA refuses), so one test
// process can be both engine and sidecar.
//
// Test-only helpers: standin_live_opens() counts open IPC mappings.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef struct {
    char reserved[64];
} cudaIpcMemHandle_t;

typedef int cudaError_t;
enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidDevice = 101,
    cudaErrorDeviceUninitialized = 201,
    cudaErrorMapBufferObjectFailed = 205,
    cudaErrorInvalidResourceHandle = 400,
};

#define NDEVICES 4
#define MAXSLOTS 256

static __thread int cur_dev = -1;

struct slot {
    int used;
    int ipc; // 1: an IPC open (refcounted), 0: a cudaMalloc
    char name[48];
    void *ptr;
    uint64_t size;
    int device;
    int refs;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct slot slots[MAXSLOTS];
static unsigned long mallocs;

EXPORT const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorDeviceUninitialized: return "invalid device context";
    case cudaErrorMapBufferObjectFailed: return "mapping of buffer object failed";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    }
    return "unrecognized error code";
}

EXPORT cudaError_t cudaSetDevice(int device) {
    if (device < 0 || device >= NDEVICES) return cudaErrorInvalidDevice;
    cur_dev = device;
    return cudaSuccess;
}

EXPORT cudaError_t cudaGetDevice(int *device) {
    if (!device) return cudaErrorInvalidValue;
    *device = cur_dev < 0 ? 0 : cur_dev;
    return cudaSuccess;
}

static struct slot *free_slot(void) {
    for (int i = 0; i < MAXSLOTS; i++)
        if (!slots[i].used) return &slots[i];
    return NULL;
}

static void *map_name(const char *name, uint64_t size, int create) {
    char path[80];
    snprintf(path, sizeof path, "/dev/shm/%s", name);
    int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | (create ? O_CREAT | O_EXCL : 0), 0600);
    if (fd < 0) return NULL;
    struct stat st;
    if (create && ftruncate(fd, (off_t)size) != 0) goto fail;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size < size) goto fail;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    return p == MAP_FAILED ? NULL : p;
fail:
    close(fd);
    if (create) unlink(path);
    return NULL;
}

// cudaMalloc: "device memory" on the current device, a new shm file.
EXPORT cudaError_t cudaMalloc(void **devPtr, size_t size) {
    if (!devPtr || size == 0) return cudaErrorInvalidValue;
    pthread_mutex_lock(&mu);
    struct slot *s = free_slot();
    if (!s) {
        pthread_mutex_unlock(&mu);
        return cudaErrorMemoryAllocation;
    }
    snprintf(s->name, sizeof s->name, "kvhost-standin-%d-%lu", (int)getpid(), ++mallocs);
    void *p = map_name(s->name, size, 1);
    if (!p) {
        pthread_mutex_unlock(&mu);
        return cudaErrorMemoryAllocation;
    }
    s->used = 1;
    s->ipc = 0;
    s->ptr = p;
    s->size = size;
    s->device = cur_dev < 0 ? 0 : cur_dev;
    s->refs = 1;
    *devPtr = p;
    pthread_mutex_unlock(&mu);
    return cudaSuccess;
}

EXPORT cudaError_t cudaFree(void *devPtr) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAXSLOTS; i++) {
        struct slot *s = &slots[i];
        if (s->used && !s->ipc && s->ptr == devPtr) {
            char path[80];
            snprintf(path, sizeof path, "/dev/shm/%s", s->name);
            munmap(s->ptr, s->size);
            unlink(path);
            s->used = 0;
            pthread_mutex_unlock(&mu);
            return cudaSuccess;
        }
    }
    pthread_mutex_unlock(&mu);
    return cudaErrorInvalidValue;
}

EXPORT cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *handle, void *devPtr) {
    if (!handle) return cudaErrorInvalidValue;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAXSLOTS; i++) {
        struct slot *s = &slots[i];
        if (s->used && !s->ipc && s->ptr == devPtr) {
            memset(handle, 0, sizeof *handle);
            memcpy(handle->reserved, "KVSI", 4);
            int32_t dev = s->device;
            memcpy(handle->reserved + 4, &dev, 4);
            memcpy(handle->reserved + 8, s->name, strlen(s->name) + 1);
            memcpy(handle->reserved + 56, &s->size, 8);
            pthread_mutex_unlock(&mu);
            return cudaSuccess;
        }
    }
    pthread_mutex_unlock(&mu);
    return cudaErrorInvalidValue;
}

// cudaIpcOpenMemHandle: maps the handle's shm file; a handle already open
// in this process returns the same pointer and counts a reference, as
// CUDA does.
EXPORT cudaError_t cudaIpcOpenMemHandle(void **devPtr, cudaIpcMemHandle_t handle, unsigned int flags) {
    if (!devPtr || flags != 1) return cudaErrorInvalidValue;
    if (memcmp(handle.reserved, "KVSI", 4) != 0) return cudaErrorInvalidResourceHandle;
    int32_t dev;
    uint64_t size;
    char name[48];
    memcpy(&dev, handle.reserved + 4, 4);
    memcpy(name, handle.reserved + 8, sizeof name);
    memcpy(&size, handle.reserved + 56, 8);
    if (memchr(name, 0, sizeof name) == NULL || name[0] == 0 || strchr(name, '/') || size == 0)
        return cudaErrorInvalidResourceHandle;
    if (cur_dev != dev) return cudaErrorDeviceUninitialized;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAXSLOTS; i++) {
        struct slot *s = &slots[i];
        if (s->used && s->ipc && strcmp(s->name, name) == 0) {
            s->refs++;
            *devPtr = s->ptr;
            pthread_mutex_unlock(&mu);
            return cudaSuccess;
        }
    }
    struct slot *s = free_slot();
    if (!s) {
        pthread_mutex_unlock(&mu);
        return cudaErrorMemoryAllocation;
    }
    void *p = map_name(name, size, 0);
    if (!p) {
        pthread_mutex_unlock(&mu);
        return cudaErrorMapBufferObjectFailed;
    }
    s->used = 1;
    s->ipc = 1;
    memcpy(s->name, name, sizeof s->name);
    s->ptr = p;
    s->size = size;
    s->device = dev;
    s->refs = 1;
    *devPtr = p;
    pthread_mutex_unlock(&mu);
    return cudaSuccess;
}

EXPORT cudaError_t cudaIpcCloseMemHandle(void *devPtr) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAXSLOTS; i++) {
        struct slot *s = &slots[i];
        if (s->used && s->ipc && s->ptr == devPtr) {
            if (--s->refs == 0) {
                munmap(s->ptr, s->size);
                s->used = 0;
            }
            pthread_mutex_unlock(&mu);
            return cudaSuccess;
        }
    }
    pthread_mutex_unlock(&mu);
    return cudaErrorInvalidValue;
}

EXPORT int standin_live_opens(void) {
    int n = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAXSLOTS; i++)
        if (slots[i].used && slots[i].ipc) n += slots[i].refs;
    pthread_mutex_unlock(&mu);
    return n;
}
