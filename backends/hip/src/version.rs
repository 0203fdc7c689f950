//! The HIP runtime version and the `hipMemAllocationProp` layout it implies.

use std::fmt;

/// A `hipRuntimeGetVersion` value: `HIP_VERSION = major * 10_000_000 + minor * 100_000 + patch`
/// (50221153 is ROCm 5.2, patch 21153).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RuntimeVersion(pub i32);

impl RuntimeVersion {
    /// The version `major.minor.patch` in HIP's encoding.
    pub const fn new(major: i32, minor: i32, patch: i32) -> Self {
        RuntimeVersion(major * 10_000_000 + minor * 100_000 + patch)
    }

    /// The raw value.
    pub fn raw(self) -> i32 {
        self.0
    }

    /// The major version (5 for ROCm 5.2).
    pub fn major(self) -> i32 {
        self.0 / 10_000_000
    }

    /// The minor version (2 for ROCm 5.2).
    pub fn minor(self) -> i32 {
        (self.0 % 10_000_000) / 100_000
    }

    /// The patch (build) number (21153 for Debian's ROCm 5.2.3).
    pub fn patch(self) -> i32 {
        self.0 % 100_000
    }
}

impl fmt::Display for RuntimeVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major(), self.minor(), self.patch())
    }
}

/// Which `hipMemAllocationProp` layout a runtime expects (see [`crate::driver`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PropLayout {
    /// ROCm 5.2: `compressionType` first ([`crate::driver::HipMemAllocationPropV52`]).
    Rocm52,
    /// ROCm >= 5.4 (and 6.x, 7.x): CUDA's layout ([`crate::driver::HipMemAllocationPropV54`]).
    Rocm54,
}

/// The oldest runtime accepted: ROCm 5.2.
///
/// The VMM entry points first appear in ROCm 5.1 (Debian's 5.2.3 exports them with the symbol
/// version `hip_5.1`), but 5.2 is the oldest release whose `hipMemAllocationProp` layout we
/// have verified against its header. 5.1 and 5.3 are refused rather than guessed.
pub const MINIMUM_VERSION: RuntimeVersion = RuntimeVersion::new(5, 2, 0);

/// The first release with the CUDA-like layout that we have verified: ROCm 5.4.
pub const CUDA_LAYOUT_VERSION: RuntimeVersion = RuntimeVersion::new(5, 4, 0);

/// The first major release whose layout is not verified yet: ROCm 8.
pub const UNVERIFIED_FROM: RuntimeVersion = RuntimeVersion::new(8, 0, 0);

/// The layout of `hipMemAllocationProp` for `version`, or why that version is refused.
///
/// * `< 5.2`: refused (the VMM API is missing, or its layout is unverified).
/// * `5.2.x`: [`PropLayout::Rocm52`].
/// * `5.3.x`: refused (a transition release whose header we have not verified).
/// * `>= 5.4` and `< 8.0`: [`PropLayout::Rocm54`].
/// * `>= 8.0`: refused until its header is checked.
pub fn layout_for(version: RuntimeVersion) -> Result<PropLayout, String> {
    if version < MINIMUM_VERSION {
        Err(format!(
            "HIP runtime {version} is too old: the virtual-memory API needs ROCm >= {}.{}",
            MINIMUM_VERSION.major(),
            MINIMUM_VERSION.minor()
        ))
    } else if version.major() == 5 && version.minor() == 2 {
        Ok(PropLayout::Rocm52)
    } else if version < CUDA_LAYOUT_VERSION {
        Err(format!(
            "HIP runtime {version}: the hipMemAllocationProp layout of ROCm {}.{} is not verified \
             (kvvm-hip supports 5.2.x and 5.4 to 7.x); refusing rather than guessing",
            version.major(),
            version.minor()
        ))
    } else if version < UNVERIFIED_FROM {
        Ok(PropLayout::Rocm54)
    } else {
        Err(format!(
            "HIP runtime {version}: the hipMemAllocationProp layout of ROCm {} is not verified \
             yet (kvvm-hip supports 5.2.x and 5.4 to 7.x); refusing rather than guessing",
            version.major()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debian_rocm_5_2_decodes() {
        let v = RuntimeVersion(50221153);
        assert_eq!((v.major(), v.minor(), v.patch()), (5, 2, 21153));
        assert_eq!(v.to_string(), "5.2.21153");
        assert_eq!(RuntimeVersion::new(5, 2, 21153), v);
        assert_eq!(layout_for(v), Ok(PropLayout::Rocm52));
    }

    #[test]
    fn layouts_by_version() {
        assert_eq!(
            layout_for(RuntimeVersion::new(5, 4, 22803)),
            Ok(PropLayout::Rocm54)
        );
        assert_eq!(
            layout_for(RuntimeVersion::new(6, 2, 41134)),
            Ok(PropLayout::Rocm54)
        );
        assert_eq!(
            layout_for(RuntimeVersion::new(7, 2, 0)),
            Ok(PropLayout::Rocm54)
        );
    }

    #[test]
    fn unverified_versions_are_refused_with_the_version_named() {
        for (v, text) in [
            (RuntimeVersion::new(5, 1, 20531), "5.1.20531"),
            (RuntimeVersion::new(4, 5, 2), "4.5.2"),
            (RuntimeVersion::new(5, 3, 22061), "5.3.22061"),
            (RuntimeVersion::new(8, 0, 1), "8.0.1"),
        ] {
            let e = layout_for(v).expect_err("refused");
            assert!(e.contains(text), "{e}");
        }
    }
}
