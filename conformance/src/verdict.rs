//! What a case returns: [`Outcome`], and [`Verdict`] when it did not pass.

use kvvm_hal::BackendError;

/// Why a case did not pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The backend misbehaved.
    Fail(String),
    /// The case cannot run here.
    Skip(String),
}

impl From<BackendError> for Verdict {
    fn from(e: BackendError) -> Self {
        Verdict::Fail(format!("unexpected error: {e}"))
    }
}

/// What a case returns.
pub type Outcome = Result<(), Verdict>;
