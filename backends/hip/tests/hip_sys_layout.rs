//! Our hand-written ROCm >= 5.4 `hipMemAllocationProp` against hip-sys 0.1.2's bindgen
//! bindings (generated from the ROCm 5.4 headers), field by field.
//!
//! Opt-in: `cargo test -p kvvm-hip --features hip-sys-check --test hip_sys_layout`.
//! hip-sys links libamdhip64 at build time, so this never runs in the default build (see
//! README.md).
#![cfg(feature = "hip-sys-check")]

use std::mem::{align_of, offset_of, size_of};

use hip_sys::hiprt;
use kvvm_hip::driver::{
    HipMemAccessDesc, HipMemAllocationPropV54, HipMemLocation, HIP_MEM_ACCESS_FLAGS_PROT_READ,
    HIP_MEM_ACCESS_FLAGS_PROT_READ_WRITE, HIP_MEM_ALLOCATION_GRANULARITY_RECOMMENDED,
    HIP_MEM_ALLOCATION_TYPE_PINNED, HIP_MEM_HANDLE_TYPE_POSIX_FD, HIP_MEM_LOCATION_TYPE_DEVICE,
};

#[test]
fn bindings_are_from_rocm_5_4_or_later() {
    assert!((hiprt::HIP_VERSION_MAJOR, hiprt::HIP_VERSION_MINOR) >= (5, 4));
}

#[test]
fn allocation_prop_matches_field_by_field() {
    type Theirs = hiprt::hipMemAllocationProp;
    type Ours = HipMemAllocationPropV54;
    assert_eq!(size_of::<Ours>(), size_of::<Theirs>());
    assert_eq!(align_of::<Ours>(), align_of::<Theirs>());
    assert_eq!(offset_of!(Ours, type_), offset_of!(Theirs, type_));
    assert_eq!(
        offset_of!(Ours, requested_handle_type),
        offset_of!(Theirs, requestedHandleType)
    );
    assert_eq!(offset_of!(Ours, location), offset_of!(Theirs, location));
    assert_eq!(
        offset_of!(Ours, location.type_),
        offset_of!(Theirs, location.type_)
    );
    assert_eq!(
        offset_of!(Ours, location.id),
        offset_of!(Theirs, location.id)
    );
    assert_eq!(
        offset_of!(Ours, win32_handle_meta_data),
        offset_of!(Theirs, win32HandleMetaData)
    );
    assert_eq!(
        offset_of!(Ours, alloc_flags),
        offset_of!(Theirs, allocFlags)
    );
    assert_eq!(
        offset_of!(Ours, alloc_flags.compression_type),
        offset_of!(Theirs, allocFlags.compressionType)
    );
    assert_eq!(
        offset_of!(Ours, alloc_flags.gpu_direct_rdma_capable),
        offset_of!(Theirs, allocFlags.gpuDirectRDMACapable)
    );
    assert_eq!(
        offset_of!(Ours, alloc_flags.usage),
        offset_of!(Theirs, allocFlags.usage)
    );
}

#[test]
fn location_and_access_desc_match() {
    assert_eq!(
        size_of::<HipMemLocation>(),
        size_of::<hiprt::hipMemLocation>()
    );
    assert_eq!(
        offset_of!(HipMemLocation, id),
        offset_of!(hiprt::hipMemLocation, id)
    );
    assert_eq!(
        size_of::<HipMemAccessDesc>(),
        size_of::<hiprt::hipMemAccessDesc>()
    );
    assert_eq!(
        offset_of!(HipMemAccessDesc, flags),
        offset_of!(hiprt::hipMemAccessDesc, flags)
    );
}

#[test]
fn enum_values_match() {
    assert_eq!(
        hiprt::hipMemAllocationType::hipMemAllocationTypePinned as u32,
        HIP_MEM_ALLOCATION_TYPE_PINNED
    );
    assert_eq!(
        hiprt::hipMemLocationType::hipMemLocationTypeDevice as u32,
        HIP_MEM_LOCATION_TYPE_DEVICE
    );
    assert_eq!(
        hiprt::hipMemAccessFlags::hipMemAccessFlagsProtRead as u32,
        HIP_MEM_ACCESS_FLAGS_PROT_READ
    );
    assert_eq!(
        hiprt::hipMemAccessFlags::hipMemAccessFlagsProtReadWrite as u32,
        HIP_MEM_ACCESS_FLAGS_PROT_READ_WRITE
    );
    assert_eq!(
        hiprt::hipMemAllocationHandleType::hipMemHandleTypePosixFileDescriptor as u32,
        HIP_MEM_HANDLE_TYPE_POSIX_FD
    );
    assert_eq!(
        hiprt::hipMemAllocationGranularity_flags::hipMemAllocationGranularityRecommended as u32,
        HIP_MEM_ALLOCATION_GRANULARITY_RECOMMENDED
    );
}
