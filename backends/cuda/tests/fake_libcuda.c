/*
 * A fake libcuda.so for tests/fake_driver.rs: just enough of the driver API for kvvm-cuda's
 * open/trait/probe code paths to run on a machine without CUDA. It checks the arguments the
 * backend passes (struct layouts, enum values, offsets, the PTX image) and records them for
 * the test to read back through the fake_* functions.
 *
 * Built by the test with `cc -shared -fPIC`. With -DONLY_INIT it exports cuInit alone (to test
 * the missing-symbol path). Behaviour switches: FAKE_CUDA_MODE=nodevice (cuInit -> 100),
 * FAKE_CUDA_MODE=zero (no device), FAKE_CUDA_NO_FD=1 (device 1 lacks POSIX FD handles).
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUhandle;

typedef struct { unsigned int type; int id; } Loc;
typedef struct {
    unsigned int type;
    unsigned int requestedHandleTypes;
    Loc location;
    void *win32HandleMetaData;
    unsigned char compressionType, gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
} Prop;
typedef struct { Loc location; unsigned int flags; } AccessDesc;

#define GRAN (2ull << 20)
#define TOTAL (141ull << 30)

CUresult cuInit(unsigned int flags) {
    const char *m = getenv("FAKE_CUDA_MODE");
    if (flags != 0) return 1;
    if (m && strcmp(m, "nodevice") == 0) return 100;
    return 0;
}

#ifndef ONLY_INIT

static int n_devices(void) {
    const char *m = getenv("FAKE_CUDA_MODE");
    return (m && strcmp(m, "zero") == 0) ? 0 : 2;
}

static int ctx_objects[2];
static int refcount[2];
static __thread void *current;
static int set_current_calls;
static unsigned char memory[1 << 16];
static CUdeviceptr next_va = 0x7f0000000000ull;
static CUhandle next_handle = 1;
static unsigned int last_handle_type = 99;
static int last_create_device = -1;
static AccessDesc last_access[8];
static int last_access_count = -1;
static unsigned int last_grid, last_block;
static int sticky;

/* Test hooks. */
int fake_refcount(int dev) { return refcount[dev]; }
int fake_set_current_calls(void) { return set_current_calls; }
unsigned int fake_last_handle_type(void) { return last_handle_type; }
int fake_last_create_device(void) { return last_create_device; }
int fake_last_access(int i, int *id, unsigned int *flags, unsigned int *loc_type) {
    if (i >= 0 && i < 8) { *id = last_access[i].location.id; *flags = last_access[i].flags;
        *loc_type = last_access[i].location.type; }
    return last_access_count;
}
unsigned int fake_last_grid(void) { return last_grid; }
unsigned int fake_last_block(void) { return last_block; }

static unsigned char *mem(CUdeviceptr p) { return &memory[p & 0xffff]; }
static int valid_ctx(void) { return current == &ctx_objects[0] || current == &ctx_objects[1]; }
static int check_prop(const Prop *p) {
    if (sizeof(Prop) != 32) return 0;
    if (p->type != 1 || p->location.type != 1) return 0;
    if (p->location.id < 0 || p->location.id >= n_devices()) return 0;
    if (p->requestedHandleTypes > 1 || p->win32HandleMetaData != NULL) return 0;
    if (p->compressionType || p->gpuDirectRDMACapable || p->usage) return 0;
    return 1;
}

CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuGetErrorName(CUresult e, const char **s) {
    static char buf[64];
    if (e == 12345) { snprintf(buf, sizeof buf, "FAKE_ERROR_%d", e); *s = buf; return 0; }
    *s = NULL;
    return 1;
}
CUresult cuDeviceGetCount(int *n) { *n = n_devices(); return 0; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (ordinal < 0 || ordinal >= n_devices()) return 101;
    *d = ordinal + 100; /* a device handle is not the ordinal */
    return 0;
}
static int dev_index(CUdevice d) { return (d >= 100 && d < 100 + n_devices()) ? d - 100 : -1; }
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    if (dev_index(d) < 0) return 101;
    snprintf(name, (size_t)len, "Fake H200 #%d", dev_index(d));
    return 0;
}
CUresult cuDeviceTotalMem_v2(size_t *b, CUdevice d) {
    if (dev_index(d) < 0) return 101;
    *b = TOTAL;
    return 0;
}
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
    const char *nofd = getenv("FAKE_CUDA_NO_FD");
    int i = dev_index(d);
    if (i < 0) return 101;
    if (attr == 102) { *v = 1; return 0; }
    if (attr == 103) { *v = (nofd && i == 1) ? 0 : 1; return 0; }
    return 1;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) {
    int i = dev_index(d);
    if (i < 0) return 101;
    refcount[i]++;
    *ctx = &ctx_objects[i];
    return 0;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    int i = dev_index(d);
    if (i < 0 || refcount[i] == 0) return 101;
    refcount[i]--;
    return 0;
}
CUresult cuCtxGetCurrent(void **ctx) { *ctx = current; return 0; }
CUresult cuCtxSetCurrent(void *ctx) {
    if (ctx != &ctx_objects[0] && ctx != &ctx_objects[1]) return 201;
    __sync_fetch_and_add(&set_current_calls, 1);
    current = ctx;
    return 0;
}
CUresult cuCtxSynchronize(void) {
    if (!valid_ctx()) return 201;
    return sticky ? 700 : 0;
}
CUresult cuMemGetInfo_v2(size_t *f, size_t *t) {
    if (!valid_ctx()) return 201;
    *f = TOTAL - (current == &ctx_objects[1] ? (1ull << 30) : 0);
    *t = TOTAL;
    return 0;
}
CUresult cuMemGetAllocationGranularity(size_t *g, const Prop *p, int option) {
    if (!valid_ctx() || !check_prop(p) || option < 0 || option > 1) return 1;
    *g = option == 0 ? GRAN : 2 * GRAN;
    return 0;
}
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags) {
    if (!valid_ctx() || flags != 0 || size % GRAN || (align && align % GRAN)) return 1;
    if (size >= (1ull << 48)) return 2;
    if (addr) { *p = addr; return 0; }
    *p = next_va;
    next_va += size;
    return 0;
}
CUresult cuMemAddressFree(CUdeviceptr p, size_t size) { return (p && size) ? 0 : 1; }
CUresult cuMemCreate(CUhandle *h, size_t size, const Prop *p, unsigned long long flags) {
    if (!valid_ctx() || !check_prop(p) || flags != 0 || size == 0 || size % GRAN) return 1;
    if (size > TOTAL) return 2;
    last_handle_type = p->requestedHandleTypes;
    last_create_device = p->location.id;
    *h = next_handle++;
    return 0;
}
CUresult cuMemRelease(CUhandle h) { return h == 0xDEAD ? 12345 : 0; }
CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, CUhandle h, unsigned long long f) {
    if (!valid_ctx()) return 201;
    if (offset != 0 || p % GRAN || size % GRAN || f != 0) return 801;
    (void)h;
    return 0;
}
CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const AccessDesc *d, size_t count) {
    if (!valid_ctx() || sizeof(AccessDesc) != 12) return 1;
    (void)p; (void)size;
    last_access_count = (int)count;
    for (size_t i = 0; i < count && i < 8; i++) last_access[i] = d[i];
    return 0;
}
CUresult cuMemUnmap(CUdeviceptr p, size_t size) { (void)p; return size % GRAN ? 1 : 0; }
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    if (!valid_ctx()) return 201;
    if (sticky) return 700;
    for (size_t i = 0; i < n; i++) *mem(dst + i) = ((const unsigned char *)src)[i];
    return 0;
}
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    if (!valid_ctx()) return 201;
    if (sticky) return 700;
    for (size_t i = 0; i < n; i++) ((unsigned char *)dst)[i] = *mem(src + i);
    return 0;
}
CUresult cuMemExportToShareableHandle(void *out, CUhandle h, unsigned int type,
                                      unsigned long long flags) {
    (void)h;
    if (type != 1 || flags != 0) return 1;
    *(int *)out = open("/dev/null", O_RDONLY);
    return 0;
}
CUresult cuMemImportFromShareableHandle(CUhandle *h, void *os, unsigned int type) {
    int fd = (int)(intptr_t)os;
    if (type != 1 || fd < 0 || fcntl(fd, F_GETFD) < 0) return 1;
    *h = 0x1000000ull + (CUhandle)fd;
    return 0;
}
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size) {
    if (!valid_ctx() || size == 0) return 1;
    *p = 0xfff0; /* the last 16 bytes of the fake memory window */
    return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) { return p == 0xfff0 ? 0 : 1; }
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    (void)dst; (void)src; (void)n;
    return valid_ctx() ? 0 : 201;
}

static int module_object, load_fn, store_fn;
CUresult cuModuleLoadData(void **m, const void *image) {
    const char *s = image;
    if (!valid_ctx()) return 201;
    while (*s == '\n' || *s == ' ') s++;
    if (strncmp(s, ".version 7.0", 12) != 0) return 218;
    if (!strstr(s, ".target sm_70") || !strstr(s, ".address_size 64")) return 218;
    *m = &module_object;
    return 0;
}
CUresult cuModuleUnload(void *m) { return m == &module_object ? 0 : 400; }
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
    if (m != &module_object) return 400;
    if (strcmp(name, "kvvm_probe_load") == 0) { *f = &load_fn; return 0; }
    if (strcmp(name, "kvvm_probe_store") == 0) { *f = &store_fn; return 0; }
    return 500;
}
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
    if (!valid_ctx()) return 201;
    if (gy != 1 || gz != 1 || by != 1 || bz != 1 || shared != 0 || stream || extra) return 1;
    last_grid = gx;
    last_block = bx;
    CUdeviceptr ptr = *(CUdeviceptr *)params[0];
    unsigned long long len = *(unsigned long long *)params[1];
    if (f == &load_fn) {
        CUdeviceptr out = *(CUdeviceptr *)params[2];
        unsigned long long sum, add = 0;
        for (unsigned long long i = 0; i < len; i++) add += *mem(ptr + i);
        memcpy(&sum, mem(out), 8);
        sum += add;
        memcpy(mem(out), &sum, 8);
        return 0;
    }
    if (f == &store_fn) {
        unsigned int value = *(unsigned int *)params[2];
        if (ptr & 1ull << 62) { sticky = 1; return 0; } /* "read-only": fault at sync */
        for (unsigned long long i = 0; i < len; i++) *mem(ptr + i) = (unsigned char)value;
        return 0;
    }
    return 400;
}

/* The host tier: pinned memory from malloc, copies made at once (checked in the current
 * context), streams and events as counted objects; a query reports "not ready" once per
 * event (CUDA_ERROR_NOT_READY, 600) to exercise that path. */
static int streams_live, events_live, host_live;
static int stream_objects[4], event_objects[64], event_queried[64];
int fake_tier_live(void) { return streams_live * 10000 + events_live * 100 + host_live; }
CUresult cuMemHostAlloc(void **p, size_t size, unsigned int flags) {
    if (!valid_ctx() || flags != 1 || size == 0) return 1;
    *p = calloc(1, size);
    if (!*p) return 2;
    host_live++;
    return 0;
}
CUresult cuMemFreeHost(void *p) { if (!p) return 1; free(p); host_live--; return 0; }
static int event_index(void *e) {
    for (int i = 0; i < 64; i++) if (e == &event_objects[i]) return i;
    return -1;
}
static int stream_ok(void *s) {
    return s == NULL || (s >= (void *)&stream_objects[0] && s <= (void *)&stream_objects[3]);
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *stream) {
    if (!valid_ctx() || !stream_ok(stream)) return 201;
    for (size_t i = 0; i < n; i++) ((unsigned char *)dst)[i] = *mem(src + i);
    return 0;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *stream) {
    if (!valid_ctx() || !stream_ok(stream)) return 201;
    for (size_t i = 0; i < n; i++) *mem(dst + i) = ((const unsigned char *)src)[i];
    return 0;
}
CUresult cuStreamCreate(void **s, unsigned int flags) {
    if (!valid_ctx() || flags != 1 || streams_live >= 4) return 1;
    *s = &stream_objects[streams_live++];
    return 0;
}
CUresult cuStreamDestroy_v2(void *s) { if (!stream_ok(s) || !s) return 400; streams_live--; return 0; }
CUresult cuEventCreate(void **e, unsigned int flags) {
    if (!valid_ctx() || flags != 2) return 1;
    for (int i = 0; i < 64; i++)
        if (event_queried[i] == 0) { event_queried[i] = 1; *e = &event_objects[i]; events_live++; return 0; }
    return 2;
}
CUresult cuEventRecord(void *e, void *stream) { return event_index(e) < 0 || !stream_ok(stream) ? 400 : 0; }
CUresult cuEventQuery(void *e) {
    int i = event_index(e);
    if (i < 0) return 400;
    if (event_queried[i] == 1) { event_queried[i] = 2; return 600; }
    return 0;
}
CUresult cuEventSynchronize(void *e) { return event_index(e) < 0 ? 400 : 0; }
CUresult cuEventDestroy_v2(void *e) {
    int i = event_index(e);
    if (i < 0 || event_queried[i] == 0) return 400;
    event_queried[i] = 0;
    events_live--;
    return 0;
}
CUresult cuStreamWaitEvent(void *s, void *e, unsigned int flags) {
    return event_index(e) < 0 || !stream_ok(s) || flags ? 400 : 0;
}

#endif /* ONLY_INIT */
CUresult cuDeviceCanAccessPeer(int *can, CUdevice d, CUdevice peer) {
    if (d < 0 || d >= n_devices() || peer < 0 || peer >= n_devices()) return 101;
    *can = d != peer;
    return 0;
}
CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
    (void)p;
    if (attr != 9) return 1;
    *(int *)data = 0;
    return 0;
}
