//! The row-copy kernel: hand-written PTX (ISA 7.0, sm_70), JIT-compiled by the driver, and the
//! module that holds it on a device. `kvvm_copy_rows(dst, dst_pitch, src, src_pitch, words,
//! rows)` copies `words` 32-bit words per row, a block per row (grid-stride over rows), the
//! block's threads over the words. The launch is `backend/rows.rs`.

use std::ffi::{c_uint, CStr};

use cudarc::driver::sys::{CUfunction, CUmodule};

use crate::driver::{CuResult, Driver};

/// The PTX text of the row-copy kernel.
pub const ROWS_PTX: &CStr = cr#"
.version 7.0
.target sm_70
.address_size 64

// kvvm_copy_rows(dst, dst_pitch, src, src_pitch, words, rows): for every row r < rows and word
// i < words, ((u32*)(dst + r * dst_pitch))[i] = ((u32*)(src + r * src_pitch))[i].
.visible .entry kvvm_copy_rows(
    .param .u64 kvvm_copy_rows_dst,
    .param .u64 kvvm_copy_rows_dst_pitch,
    .param .u64 kvvm_copy_rows_src,
    .param .u64 kvvm_copy_rows_src_pitch,
    .param .u64 kvvm_copy_rows_words,
    .param .u64 kvvm_copy_rows_rows
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<6>;
    .reg .b64 %rd<17>;

    ld.param.u64 %rd1, [kvvm_copy_rows_dst];
    ld.param.u64 %rd2, [kvvm_copy_rows_dst_pitch];
    ld.param.u64 %rd3, [kvvm_copy_rows_src];
    ld.param.u64 %rd4, [kvvm_copy_rows_src_pitch];
    ld.param.u64 %rd5, [kvvm_copy_rows_words];
    ld.param.u64 %rd6, [kvvm_copy_rows_rows];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd3, %rd3;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %nctaid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %ntid.x;
    cvt.u64.u32 %rd7, %r1;
    cvt.u64.u32 %rd8, %r2;
    cvt.u64.u32 %rd9, %r3;
    cvt.u64.u32 %rd10, %r4;
ROW_LOOP:
    setp.ge.u64 %p1, %rd7, %rd6;
    @%p1 bra DONE;
    mad.lo.u64 %rd11, %rd7, %rd2, %rd1;
    mad.lo.u64 %rd12, %rd7, %rd4, %rd3;
    mov.u64 %rd13, %rd9;
WORD_LOOP:
    setp.ge.u64 %p2, %rd13, %rd5;
    @%p2 bra NEXT_ROW;
    shl.b64 %rd14, %rd13, 2;
    add.u64 %rd15, %rd12, %rd14;
    ld.global.u32 %r5, [%rd15];
    add.u64 %rd16, %rd11, %rd14;
    st.global.u32 [%rd16], %r5;
    add.u64 %rd13, %rd13, %rd10;
    bra.uni WORD_LOOP;
NEXT_ROW:
    add.u64 %rd7, %rd7, %rd8;
    bra.uni ROW_LOOP;
DONE:
    ret;
}
"#;

/// The kernel's name in [`ROWS_PTX`].
pub const ROWS_KERNEL: &CStr = c"kvvm_copy_rows";

/// The most blocks a launch uses (more rows are covered by the grid-stride loop).
pub(crate) const MAX_BLOCKS: u64 = 65_535;

/// The row-copy module loaded in one device's primary context.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowsModule {
    module: CUmodule,
    /// The `kvvm_copy_rows` kernel.
    pub(crate) copy: CUfunction,
}

// SAFETY: module and function handles are driver objects usable from any thread once their
// context is current; they are only handed back to the driver.
unsafe impl Send for RowsModule {}

impl RowsModule {
    /// Loads the module in the current context (which must be the device's).
    pub(crate) fn load(driver: &Driver) -> CuResult<RowsModule> {
        let (module, [copy]) = driver.module_load_functions(ROWS_PTX, [ROWS_KERNEL])?;
        Ok(RowsModule { module, copy })
    }

    /// Unloads the module.
    ///
    /// # Safety
    /// The module's context must be current, and the module must not be used again.
    pub(crate) unsafe fn unload(self, driver: &Driver) -> CuResult<()> {
        // SAFETY: by the caller's contract.
        unsafe { driver.module_unload(self.module) }
    }
}

/// Threads per block for `words` words a row: a multiple of 32, at most 256.
pub(crate) fn block_for(words: u64) -> c_uint {
    let threads = words.div_ceil(32).saturating_mul(32).clamp(32, 256);
    c_uint::try_from(threads).unwrap_or(256)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_header_and_kernel() {
        let text = ROWS_PTX.to_str().unwrap_or_default();
        assert!(text.contains(".version 7.0") && text.contains(".target sm_70"));
        assert!(text.contains(".visible .entry kvvm_copy_rows("));
        assert!(text.contains("ld.global.u32") && text.contains("st.global.u32"));
        assert_eq!(text.matches('{').count(), text.matches('}').count());
        assert_eq!(text.matches('(').count(), text.matches(')').count());
        assert_eq!(text.matches(".param .u64").count(), 6);
    }

    #[test]
    fn block_sizes() {
        assert_eq!(block_for(1), 32);
        assert_eq!(block_for(33), 64);
        assert_eq!(block_for(512), 256);
        assert_eq!(block_for(u64::MAX), 256);
    }
}
