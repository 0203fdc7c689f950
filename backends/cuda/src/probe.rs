//! The probe kernels of `KernelProbe`: hand-written PTX, JIT-compiled by the driver, and the
//! module that holds them on a device. The trait implementation is `backend/kernel.rs`.
//!
//! `kvvm_probe_load(ptr, len, out)` sums the `len` bytes at `ptr` with `ld.global.u8` (a
//! grid-stride loop; each thread adds its partial sum to `*out` with one `atom.global.add`),
//! and `kvvm_probe_store(ptr, len, value)` writes `value` into every byte with `st.global.u8`.
//! The module is loaded lazily, once per device, in that device's primary context, together
//! with an 8-byte `cuMemAlloc` buffer for `out`.

use std::ffi::{c_uint, CStr};

use crate::driver::{CuResult, Driver};
use cudarc::driver::sys::{CUdeviceptr, CUfunction, CUmodule};

/// The PTX text of the probe kernels (ISA 7.0, sm_70: the driver JITs it for newer GPUs).
pub const PROBE_PTX: &CStr = cr#"
.version 7.0
.target sm_70
.address_size 64

// kvvm_probe_load(ptr, len, out): *out += sum of the bytes ptr[0..len] (one atomic per thread).
.visible .entry kvvm_probe_load(
    .param .u64 kvvm_probe_load_ptr,
    .param .u64 kvvm_probe_load_len,
    .param .u64 kvvm_probe_load_out
)
{
    .reg .pred %p<2>;
    .reg .b16 %rs<2>;
    .reg .b32 %r<5>;
    .reg .b64 %rd<12>;

    ld.param.u64 %rd1, [kvvm_probe_load_ptr];
    ld.param.u64 %rd2, [kvvm_probe_load_len];
    ld.param.u64 %rd3, [kvvm_probe_load_out];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd3, %rd3;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    cvt.u64.u32 %rd4, %r3;
    mad.wide.u32 %rd5, %r1, %r2, %rd4;
    mul.wide.u32 %rd6, %r4, %r2;
    mov.u64 %rd7, 0;
LOAD_LOOP:
    setp.ge.u64 %p1, %rd5, %rd2;
    @%p1 bra LOAD_DONE;
    add.u64 %rd8, %rd1, %rd5;
    ld.global.u8 %rs1, [%rd8];
    cvt.u64.u16 %rd9, %rs1;
    add.u64 %rd7, %rd7, %rd9;
    add.u64 %rd5, %rd5, %rd6;
    bra.uni LOAD_LOOP;
LOAD_DONE:
    atom.global.add.u64 %rd10, [%rd3], %rd7;
    ret;
}

// kvvm_probe_store(ptr, len, value): ptr[i] = value for every i < len.
.visible .entry kvvm_probe_store(
    .param .u64 kvvm_probe_store_ptr,
    .param .u64 kvvm_probe_store_len,
    .param .u32 kvvm_probe_store_value
)
{
    .reg .pred %p<2>;
    .reg .b16 %rs<2>;
    .reg .b32 %r<6>;
    .reg .b64 %rd<10>;

    ld.param.u64 %rd1, [kvvm_probe_store_ptr];
    ld.param.u64 %rd2, [kvvm_probe_store_len];
    ld.param.u32 %r5, [kvvm_probe_store_value];
    cvt.u16.u32 %rs1, %r5;
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    cvt.u64.u32 %rd4, %r3;
    mad.wide.u32 %rd5, %r1, %r2, %rd4;
    mul.wide.u32 %rd6, %r4, %r2;
STORE_LOOP:
    setp.ge.u64 %p1, %rd5, %rd2;
    @%p1 bra STORE_DONE;
    add.u64 %rd8, %rd1, %rd5;
    st.global.u8 [%rd8], %rs1;
    add.u64 %rd5, %rd5, %rd6;
    bra.uni STORE_LOOP;
STORE_DONE:
    ret;
}
"#;

/// Name of the load kernel in [`PROBE_PTX`].
pub const LOAD_KERNEL: &CStr = c"kvvm_probe_load";
/// Name of the store kernel in [`PROBE_PTX`].
pub const STORE_KERNEL: &CStr = c"kvvm_probe_store";

/// Threads per block of a probe launch.
pub(crate) const BLOCK: u64 = 256;
/// Most blocks of a probe launch (the kernels loop over the rest).
const MAX_BLOCKS: u64 = 1024;

/// The grid size for `len` bytes: one thread a byte, at most `MAX_BLOCKS` blocks, at least 1.
pub(crate) fn grid_for(len: u64) -> c_uint {
    let blocks = len.div_ceil(BLOCK).clamp(1, MAX_BLOCKS);
    c_uint::try_from(blocks).unwrap_or(1)
}

/// The probe module of one device: the module, its two functions and the `out` buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProbeModule {
    module: CUmodule,
    pub(crate) load: CUfunction,
    pub(crate) store: CUfunction,
    pub(crate) out: CUdeviceptr,
}

// SAFETY: module and function handles are driver objects usable from any thread once their
// context is current; they are only handed back to the driver, under the device's mutex.
unsafe impl Send for ProbeModule {}

impl ProbeModule {
    /// Loads the probe module in the current context (which must be the device's).
    pub(crate) fn load(driver: &Driver) -> CuResult<ProbeModule> {
        let (module, [load, store]) =
            driver.module_load_functions(PROBE_PTX, [LOAD_KERNEL, STORE_KERNEL])?;
        match driver.mem_alloc(8) {
            Ok(out) => Ok(ProbeModule {
                module,
                load,
                store,
                out,
            }),
            Err(code) => {
                // SAFETY: the module is loaded and nothing refers to it.
                let _ = unsafe { driver.module_unload(module) };
                Err(code)
            }
        }
    }

    /// Frees the `out` buffer and unloads the module.
    ///
    /// # Safety
    /// The module's context must be current, and the module must not be used again.
    pub(crate) unsafe fn unload(self, driver: &Driver) -> CuResult<()> {
        let freed = driver.mem_free(self.out);
        // SAFETY: the caller guarantees the module is no longer used.
        let unloaded = unsafe { driver.module_unload(self.module) };
        freed.and(unloaded)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_header_and_kernels() {
        let text = PROBE_PTX.to_str().map_err(|e| e.to_string());
        assert!(text.is_ok(), "PTX is ASCII");
        let text = text.unwrap_or_default();
        assert!(text.contains(".version 7.0"));
        assert!(text.contains(".target sm_70"));
        assert!(text.contains(".address_size 64"));
        for name in [LOAD_KERNEL, STORE_KERNEL] {
            let name = name.to_str().unwrap_or_default();
            assert!(text.contains(&format!(".visible .entry {name}(")), "{name}");
        }
        assert!(text.contains("ld.global.u8"));
        assert!(text.contains("st.global.u8"));
        // Balanced braces and parentheses.
        assert_eq!(text.matches('{').count(), text.matches('}').count());
        assert_eq!(text.matches('(').count(), text.matches(')').count());
    }

    #[test]
    fn grid_sizes() {
        assert_eq!(grid_for(0), 1);
        assert_eq!(grid_for(1), 1);
        assert_eq!(grid_for(256), 1);
        assert_eq!(grid_for(257), 2);
        assert_eq!(grid_for(2 << 20), 1024);
        assert_eq!(grid_for(u64::MAX), 1024);
    }
}
