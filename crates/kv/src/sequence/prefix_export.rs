//! A [`SharedDevicePrefix`] handed to another process: [`export`](SharedDevicePrefix::export)
//! gives its handles as descriptors with a [`PrefixDescriptor`] (what the windows hold, where
//! each handle lies), [`import`](SharedDevicePrefix::import) makes the same prefix in another
//! manager from them, mapped read-only there and billed where it was made. A node's broker
//! carries both (`kvvm-broker`: the descriptor's [`encode`](PrefixDescriptor::encode)d text
//! rides with the descriptors).

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use kvvm_layout::{evaluate_prefix_shareability, LayoutPlan};
use kvvm_num::{add, mul};
use kvvm_vmm::VirtualMemory;

use crate::error::KvCacheError;
use crate::sequence::prefix::SharedDevicePrefix;

/// The first word of an encoded descriptor, with its version.
const TAG: &str = "kvvm-prefix/1";

/// What an importer needs besides the descriptors: the prefix's length in tokens (only tokens
/// lying entirely in its shared windows: the owner's partial tail is not exported) and, per
/// handle in the order of the descriptors, its offset in the reservation and its windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixDescriptor {
    /// Tokens readable from the shared windows (from token 0).
    pub tokens: u64,
    /// First shared window of every fragment (0: the prefix starts at token 0).
    pub first_window: u64,
    /// One past the last shared window of every fragment.
    pub end_window: u64,
    /// `(offset, windows)` of each handle, in the order of the descriptors.
    pub pieces: Vec<(u64, u64)>,
}

impl PrefixDescriptor {
    /// One line of text (`kvvm-prefix/1 <tokens> <first> <end> <offset>:<windows> ...`), what
    /// a broker carries beside the descriptors.
    pub fn encode(&self) -> String {
        let pieces: Vec<String> = self
            .pieces
            .iter()
            .map(|(o, w)| format!("{o}:{w}"))
            .collect();
        format!(
            "{TAG} {} {} {} {}",
            self.tokens,
            self.first_window,
            self.end_window,
            pieces.join(" ")
        )
    }

    /// The descriptor [`encode`](Self::encode) wrote; [`KvCacheError::PlanMismatch`] for any
    /// other text, and for one whose windows cannot be a prefix's (checked before anything
    /// is built from them: no window range empty or past 2^20 windows, no piece of 0
    /// windows, pieces of 2^20 windows at most in all, and at least as many as one
    /// fragment's range).
    pub fn decode(text: &str) -> Result<Self, KvCacheError> {
        /// The most windows a descriptor may name (a prefix of 2 TiB in 2 MiB windows).
        const MAX_WINDOWS: u64 = 1 << 20;
        let bad = || KvCacheError::PlanMismatch {
            reason: format!("not a kvvm prefix descriptor: {text:?}"),
        };
        let mut words = text.split_ascii_whitespace();
        if words.next() != Some(TAG) {
            return Err(bad());
        }
        let mut number = || {
            words
                .next()
                .and_then(|w| w.parse::<u64>().ok())
                .ok_or_else(bad)
        };
        let (tokens, first_window, end_window) = (number()?, number()?, number()?);
        let pieces = words
            .map(|w| {
                let (o, n) = w.split_once(':').ok_or_else(bad)?;
                Ok((o.parse().map_err(|_| bad())?, n.parse().map_err(|_| bad())?))
            })
            .collect::<Result<Vec<(u64, u64)>, KvCacheError>>()?;
        let range = end_window.saturating_sub(first_window);
        let windows = pieces
            .iter()
            .try_fold(0u64, |a, (_, w)| {
                (*w > 0).then(|| a.checked_add(*w)).flatten()
            })
            .unwrap_or(u64::MAX);
        if range == 0 || end_window > MAX_WINDOWS || windows > MAX_WINDOWS || windows < range {
            return Err(bad());
        }
        Ok(PrefixDescriptor {
            tokens,
            first_window,
            end_window,
            pieces,
        })
    }
}

impl SharedDevicePrefix {
    /// The prefix's handles as descriptors (the manager must make handles as
    /// `ShareableHandleType::PosixFd`) and their [`PrefixDescriptor`], for another process to
    /// [`import`](Self::import). Only a sealed (written) prefix is exported.
    pub fn export(&self) -> Result<(PrefixDescriptor, Vec<OwnedFd>), KvCacheError> {
        if !self.is_sealed() {
            return Err(KvCacheError::PrefixNotWritten {
                written: 0,
                needed: self.prefix_len(),
            });
        }
        let (fds, pieces) = self
            .set
            .export_fds()?
            .into_iter()
            .map(|(fd, p)| (fd, (p.offset, p.windows)))
            .unzip();
        let descriptor = PrefixDescriptor {
            tokens: self.shared_tokens().min(self.prefix_len()),
            first_window: self.first_window(),
            end_window: self.end_window(),
            pieces,
        };
        Ok((descriptor, fds))
    }

    /// The prefix another process [`export`](Self::export)ed, in `vm` under `plan` (the
    /// exporter's plan: same geometry, maximum tokens, layout and granule), sealed: sequences
    /// of this manager attach it read-only ([`attach_to`](Self::attach_to)), billed where it
    /// was made, and its memory lives while any process maps or holds it.
    ///
    /// Errors: [`KvCacheError::PlanMismatch`] when the handles are not the windows
    /// `[first_window, end_window)` of every fragment of `plan`, or the tokens do not lie in
    /// them, or the counts of descriptors and pieces differ (checked before any driver call);
    /// the import's driver errors.
    pub fn import(
        vm: &VirtualMemory,
        plan: &LayoutPlan,
        descriptor: &PrefixDescriptor,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Arc<SharedDevicePrefix>, KvCacheError> {
        let mismatch = |reason: String| KvCacheError::PlanMismatch { reason };
        if fds.len() != descriptor.pieces.len() {
            return Err(mismatch(format!(
                "{} descriptors for {} pieces",
                fds.len(),
                descriptor.pieces.len()
            )));
        }
        if plan.granule() != vm.granule() {
            return Err(mismatch(
                "the plan's granule is not the manager's".to_owned(),
            ));
        }
        check_windows(plan, descriptor)?;
        let shareability = evaluate_prefix_shareability(
            plan.geometry(),
            plan.layout(),
            descriptor.tokens,
            plan.granule(),
        )?;
        if shareability.shareable_granules_per_fragment < descriptor.end_window {
            return Err(mismatch(format!(
                "{} tokens do not fill {} windows of every fragment",
                descriptor.tokens, descriptor.end_window
            )));
        }
        let pieces: Vec<(BorrowedFd<'_>, u64, u64)> = fds
            .iter()
            .zip(&descriptor.pieces)
            .map(|(fd, (offset, windows))| (*fd, *offset, *windows))
            .collect();
        let set = vm.import_shared(&pieces)?;
        let prefix = SharedDevicePrefix::new(
            set,
            *plan,
            descriptor.first_window,
            descriptor.end_window,
            descriptor.tokens,
            shareability,
        );
        prefix.seal();
        Ok(Arc::new(prefix))
    }
}

/// Whether the descriptor's pieces are exactly windows `[first_window, end_window)` of every
/// fragment of `plan`.
fn check_windows(plan: &LayoutPlan, d: &PrefixDescriptor) -> Result<(), KvCacheError> {
    let g = plan.granule();
    let mut want: Vec<u64> = Vec::new();
    for f in plan.fragments()? {
        for w in d.first_window..d.end_window {
            want.push(add(f.offset, mul(w, g, "window offset")?, "window offset")?);
        }
    }
    let mut got: Vec<u64> = Vec::new();
    for (offset, windows) in &d.pieces {
        if *windows > want.len() as u64 {
            break;
        }
        for w in 0..*windows {
            got.push(add(*offset, mul(w, g, "window offset")?, "window offset")?);
        }
    }
    want.sort_unstable();
    got.sort_unstable();
    if want.is_empty() || want != got {
        return Err(KvCacheError::PlanMismatch {
            reason: format!(
                "the prefix's handles are not windows {}..{} of every fragment of this plan \
                 (another geometry, maximum length or layout?)",
                d.first_window, d.end_window
            ),
        });
    }
    Ok(())
}
