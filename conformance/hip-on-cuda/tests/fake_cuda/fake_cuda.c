/*
 * A fake libcuda.so.1 for tests/fake_cuda.rs: just enough of the CUDA driver's VMM API, with
 * host memory behind it, to drive kvvm-hip -> libhip_on_cuda.so -> "CUDA" end to end on a
 * machine without a GPU. The structs are declared as in cuda.h, so the C compiler's layout
 * checks the shim's hand-written CUmemAllocationProp / CUmemAccessDesc.
 *
 * Semantics follow the H200 measurements where it matters to the test: granularity 2 MiB,
 * create of a size that is not a granule multiple -> CUDA_ERROR_INVALID_VALUE (1), create past
 * the device's capacity -> CUDA_ERROR_OUT_OF_MEMORY (2), map with offset != 0 or over a live
 * mapping -> CUDA_ERROR_NOT_SUPPORTED (801), copies before set-access -> 1.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;

typedef struct { unsigned int type; int id; } CUmemLocation;
typedef struct {
    unsigned int type;
    unsigned int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; unsigned int flags; } CUmemAccessDesc;

_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp");
_Static_assert(offsetof(CUmemAllocationProp, location) == 8, "location");
_Static_assert(offsetof(CUmemAllocationProp, allocFlags) == 24, "allocFlags");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc");

#define GRANULE (2u << 20)
#define CAPACITY (64u << 20)
#define MAX 64

static int initialised;
static CUcontext current;
static struct { int live; size_t size; unsigned char *mem; int maps; } handles[MAX];
static struct { int live; CUdeviceptr va; size_t size; int handle; unsigned flags; } maps[MAX];
static size_t used;
/* The last prop seen by cuMemCreate, for the test to read back through fake_last_prop(). */
static CUmemAllocationProp last_prop;

CUresult cuInit(unsigned int flags) { (void)flags; initialised = 1; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) { if (ordinal != 0) return 101; *d = 0; return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    if (d != 0) return 101;
    *c = (CUcontext)(uintptr_t)0x1000;
    return 0;
}
CUresult cuCtxSetCurrent(CUcontext c) { current = c; return 0; }
CUresult cuCtxSynchronize(void) { return current ? 0 : 201; }
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    if (d != 0 || len < 1) return 1;
    strncpy(name, "Fake CUDA Device", (size_t)len - 1);
    name[len - 1] = 0;
    return 0;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) { if (d != 0) return 101; *bytes = CAPACITY; return 0; }
CUresult cuDeviceCanAccessPeer(int *can, CUdevice d, CUdevice peer) {
    if (d != 0 || peer != 0) return 101;
    *can = 0; /* one device: cuda.h leaves a device and itself undefined; the caller asks only for peers */
    return 0;
}
CUresult cuMemGetInfo_v2(size_t *free_, size_t *total) {
    if (!current) return 201;
    *free_ = CAPACITY - used; *total = CAPACITY; return 0;
}

static int prop_ok(const CUmemAllocationProp *p) {
    return p && p->type == 1 && p->location.type == 1 && p->location.id == 0 &&
           p->requestedHandleTypes <= 1;
}

CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p, int option) {
    if (!current) return 201;
    if (!prop_ok(p) || (option != 0 && option != 1)) return 1;
    *g = GRANULE;
    return 0;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags) {
    (void)align; (void)addr;
    if (!current) return 201;
    if (flags != 0 || size == 0 || size % GRANULE) return 1;
    void *p = NULL;
    if (posix_memalign(&p, GRANULE, size)) return 2;
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return 0;
}
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    for (int i = 0; i < MAX; i++)
        if (maps[i].live && maps[i].va >= ptr && maps[i].va < ptr + size) return 1;
    free((void *)(uintptr_t)ptr);
    return 0;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *p,
                     unsigned long long flags) {
    if (!current) return 201;
    if (p) last_prop = *p;
    if (!prop_ok(p) || flags != 0 || size == 0 || size % GRANULE) return 1;
    if (used + size > CAPACITY) return 2;
    for (int i = 1; i < MAX; i++) {
        if (!handles[i].live) {
            handles[i].mem = calloc(1, size);
            if (!handles[i].mem) return 2;
            handles[i].live = 1; handles[i].size = size; handles[i].maps = 0;
            used += size;
            *h = (CUmemGenericAllocationHandle)(0xA000 + i);
            return 0;
        }
    }
    return 2;
}

static int handle_index(CUmemGenericAllocationHandle h) {
    long i = (long)h - 0xA000;
    return (i > 0 && i < MAX && handles[i].live) ? (int)i : -1;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    int i = handle_index(h);
    if (i < 0) return 1;
    handles[i].live = 0; used -= handles[i].size; free(handles[i].mem);
    return 0;
}

CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                  unsigned long long flags) {
    int i = handle_index(h);
    if (i < 0 || flags != 0) return 1;
    if (offset != 0 || size != handles[i].size || va % GRANULE) return 801;
    for (int m = 0; m < MAX; m++)
        if (maps[m].live && va < maps[m].va + maps[m].size && maps[m].va < va + size) return 801;
    for (int m = 0; m < MAX; m++) {
        if (!maps[m].live) {
            maps[m].live = 1; maps[m].va = va; maps[m].size = size; maps[m].handle = i;
            maps[m].flags = 0;
            return 0;
        }
    }
    return 2;
}

CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const CUmemAccessDesc *d, size_t count) {
    if (count != 1 || d->location.type != 1 || d->location.id != 0) return 1;
    if (d->flags != 0 && d->flags != 1 && d->flags != 3) return 1;
    int hit = 0;
    for (int m = 0; m < MAX; m++)
        if (maps[m].live && maps[m].va >= va && maps[m].va + maps[m].size <= va + size) {
            maps[m].flags = d->flags; hit = 1;
        }
    return hit ? 0 : 1;
}

CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
    for (int m = 0; m < MAX; m++)
        if (maps[m].live && maps[m].va >= va && maps[m].va + maps[m].size <= va + size)
            maps[m].live = 0;
    return 0;
}

static unsigned char *resolve(CUdeviceptr p, size_t n, unsigned need) {
    for (int m = 0; m < MAX; m++)
        if (maps[m].live && p >= maps[m].va && p + n <= maps[m].va + maps[m].size)
            return (maps[m].flags & need) == need ? handles[maps[m].handle].mem + (p - maps[m].va)
                                                  : NULL;
    return NULL;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    unsigned char *d = resolve(dst, n, 3);
    if (!d) return 1;
    memcpy(d, src, n);
    return 0;
}
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    unsigned char *s = resolve(src, n, 1);
    if (!s) return 1;
    memcpy(dst, s, n);
    return 0;
}

CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
                                      unsigned long long flags) {
    (void)out; (void)h; (void)type; (void)flags;
    return 801;
}
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os, int type) {
    (void)h; (void)os; (void)type;
    return 801;
}

const CUmemAllocationProp *fake_last_prop(void) { return &last_prop; }
