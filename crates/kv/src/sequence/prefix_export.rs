//! A [`SharedDevicePrefix`] handed to another process: [`export`](SharedDevicePrefix::export)
//! gives its handles as descriptors with a [`PrefixDescriptor`] (what the windows hold, where
//! each handle lies), [`import`](SharedDevicePrefix::import) makes the same prefix in another
//! manager from them, mapped read-only there and billed where it was made. A node's broker
//! carries both (`kvvm-broker`: the descriptor's [`encode`](PrefixDescriptor::encode)d text
//! rides with the descriptors).
//!
//! Both the read-only windows' handles and the tail's travel, so an importer's sequences
//! receive every token of the prefix (read-only windows, then a copy of the rest).

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use kvvm_layout::{evaluate_prefix_shareability, LayoutPlan};
use kvvm_num::{add, mul};
use kvvm_vmm::{SharedHandles, VirtualMemory};

use crate::error::KvCacheError;
use crate::sequence::prefix::SharedDevicePrefix;

/// The first word of an encoded descriptor, with its version.
const TAG: &str = "kvvm-prefix/2";

/// What separates the read-only windows' pieces from the tail's in an encoded descriptor.
const TAIL_MARK: &str = "|";

/// What an importer needs besides the descriptors: the prefix's length in tokens, its
/// windows, and, per handle in the order of the descriptors (the read-only windows' handles,
/// then the tail's), its offset in the reservation and its windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixDescriptor {
    /// Tokens the prefix hands on (from token 0): those in its read-only windows and its tail.
    pub tokens: u64,
    /// First read-only window of every fragment (0: the prefix starts at token 0).
    pub first_window: u64,
    /// One past the last read-only window of every fragment.
    pub end_window: u64,
    /// One past the last window of the tail in every fragment (`end_window` when the prefix
    /// ends on a window boundary and has no tail).
    pub tail_end_window: u64,
    /// `(offset, windows)` of each handle of the read-only windows.
    pub pieces: Vec<(u64, u64)>,
    /// `(offset, windows)` of each handle of the tail, after `pieces` in the descriptors.
    pub tail_pieces: Vec<(u64, u64)>,
}

impl PrefixDescriptor {
    /// One line of text (`kvvm-prefix/2 <tokens> <first> <end> <tail end> <offset>:<windows>
    /// ... | <offset>:<windows> ...`), what a broker carries beside the descriptors.
    pub fn encode(&self) -> String {
        let words = |pieces: &[(u64, u64)]| -> Vec<String> {
            pieces.iter().map(|(o, w)| format!("{o}:{w}")).collect()
        };
        let mut out = format!(
            "{TAG} {} {} {} {}",
            self.tokens, self.first_window, self.end_window, self.tail_end_window
        );
        for w in words(&self.pieces)
            .into_iter()
            .chain(std::iter::once(TAIL_MARK.to_owned()))
            .chain(words(&self.tail_pieces))
        {
            out.push(' ');
            out.push_str(&w);
        }
        out
    }

    /// The descriptor [`encode`](Self::encode) wrote; [`KvCacheError::PlanMismatch`] for any
    /// other text. Its numbers are only parsed here; [`SharedDevicePrefix::import`] checks
    /// them against the plan before it allocates or calls the driver.
    pub fn decode(text: &str) -> Result<Self, KvCacheError> {
        let bad = || KvCacheError::PlanMismatch {
            reason: format!(
                "not a kvvm prefix descriptor: {:?}",
                text.chars().take(120).collect::<String>()
            ),
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
        let (tokens, first_window, end_window, tail_end_window) =
            (number()?, number()?, number()?, number()?);
        let piece = |w: &str| -> Result<(u64, u64), KvCacheError> {
            let (o, n) = w.split_once(':').ok_or_else(bad)?;
            Ok((o.parse().map_err(|_| bad())?, n.parse().map_err(|_| bad())?))
        };
        let (mut pieces, mut tail_pieces) = (Vec::new(), Vec::new());
        let mut in_tail = false;
        for w in words {
            match (w == TAIL_MARK, in_tail) {
                (true, false) => in_tail = true,
                (true, true) => return Err(bad()),
                (false, false) => pieces.push(piece(w)?),
                (false, true) => tail_pieces.push(piece(w)?),
            }
        }
        if !in_tail {
            return Err(bad());
        }
        Ok(PrefixDescriptor {
            tokens,
            first_window,
            end_window,
            tail_end_window,
            pieces,
            tail_pieces,
        })
    }

    /// Descriptors the importer must be given: one per piece.
    pub fn handle_count(&self) -> usize {
        self.pieces.len().saturating_add(self.tail_pieces.len())
    }
}

impl SharedDevicePrefix {
    /// The prefix's handles as descriptors (the manager must make handles as
    /// `ShareableHandleType::PosixFd`), the read-only windows' then the tail's, and their
    /// [`PrefixDescriptor`], for another process to [`import`](Self::import). Only a sealed
    /// (written) prefix is exported.
    pub fn export(&self) -> Result<(PrefixDescriptor, Vec<OwnedFd>), KvCacheError> {
        if !self.is_sealed() {
            return Err(KvCacheError::PrefixNotWritten {
                written: 0,
                needed: self.prefix_len(),
            });
        }
        let (mut fds, pieces) = split(self.set.export_fds()?);
        let tail = self.tail_handles();
        let (tail_fds, tail_pieces) = match &tail {
            Some(t) => split(t.export_fds()?),
            None => (Vec::new(), Vec::new()),
        };
        fds.extend(tail_fds);
        let descriptor = PrefixDescriptor {
            tokens: self.tokens(),
            first_window: self.first_window(),
            end_window: self.end_window(),
            tail_end_window: if tail.is_some() {
                self.tail_end_window()
            } else {
                self.end_window()
            },
            pieces,
            tail_pieces,
        };
        Ok((descriptor, fds))
    }

    /// The prefix another process [`export`](Self::export)ed, in `vm` under `plan` (the
    /// exporter's plan: same geometry, maximum tokens, layout and granule), sealed: sequences
    /// of this manager attach it ([`attach_to`](Self::attach_to)), billed where it was made,
    /// and its memory lives while any process maps or holds it.
    ///
    /// Errors: [`KvCacheError::PlanMismatch`] when the handles are not exactly the windows
    /// the tokens fill (read-only, then the tail) in every fragment of `plan`, or the counts
    /// of descriptors and pieces differ: checked arithmetically, before anything is allocated
    /// for the windows and before any driver call; the import's driver errors.
    pub fn import(
        vm: &VirtualMemory,
        plan: &LayoutPlan,
        descriptor: &PrefixDescriptor,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Arc<SharedDevicePrefix>, KvCacheError> {
        if fds.len() != descriptor.handle_count() {
            return Err(mismatch(format!(
                "{} descriptors for {} pieces",
                fds.len(),
                descriptor.handle_count()
            )));
        }
        if plan.granule() != vm.granule() {
            return Err(mismatch(
                "the plan's granule is not the manager's".to_owned(),
            ));
        }
        check_descriptor(plan, descriptor)?;
        let shareability = evaluate_prefix_shareability(
            plan.geometry(),
            plan.layout(),
            descriptor.tokens,
            plan.granule(),
        )?;
        let (ro_fds, tail_fds) = fds.split_at(descriptor.pieces.len());
        let set = import_set(vm, ro_fds, &descriptor.pieces)?;
        let tail = if descriptor.tail_pieces.is_empty() {
            None
        } else {
            Some(import_set(vm, tail_fds, &descriptor.tail_pieces)?)
        };
        let prefix = SharedDevicePrefix::new(
            set,
            *plan,
            descriptor.first_window,
            descriptor.end_window,
            descriptor.tokens,
            shareability,
        );
        if let Some(tail) = tail {
            prefix.set_imported_tail(tail);
        }
        prefix.seal();
        Ok(Arc::new(prefix))
    }
}

/// Descriptors and `(offset, windows)` of exported pieces.
fn split(exported: Vec<(OwnedFd, kvvm_vmm::SharedPiece)>) -> (Vec<OwnedFd>, Vec<(u64, u64)>) {
    exported
        .into_iter()
        .map(|(fd, p)| (fd, (p.offset, p.windows)))
        .unzip()
}

/// The imported set of `pieces` (an empty set when there are none).
fn import_set(
    vm: &VirtualMemory,
    fds: &[BorrowedFd<'_>],
    pieces: &[(u64, u64)],
) -> Result<Arc<SharedHandles>, KvCacheError> {
    if pieces.is_empty() {
        return Ok(vm.empty_shared());
    }
    let pieces: Vec<(BorrowedFd<'_>, u64, u64)> = fds
        .iter()
        .zip(pieces)
        .map(|(fd, (offset, windows))| (*fd, *offset, *windows))
        .collect();
    Ok(vm.import_shared(&pieces)?)
}

/// Whether the descriptor's numbers fit `plan`: the read-only windows hold only bytes of its
/// tokens, the tail ends where the tokens end, and the pieces cover exactly windows
/// `[first_window, end_window)` (then `[end_window, tail_end_window)`) of every fragment.
fn check_descriptor(plan: &LayoutPlan, d: &PrefixDescriptor) -> Result<(), KvCacheError> {
    let g = plan.granule();
    let bytes = mul(d.tokens, plan.fragment_bytes_per_token(), "prefix bytes")?;
    let whole = bytes / g;
    let tail_end = bytes.div_ceil(g);
    if d.tokens > plan.geometry().max_tokens()
        || d.end_window != whole
        || d.first_window > d.end_window
        || !(d.tail_end_window == tail_end
            || (d.tail_pieces.is_empty() && d.tail_end_window == whole))
    {
        return Err(mismatch(format!(
            "{} tokens do not fill windows {}..{} (tail to {}) of this plan (another geometry, \
             maximum length or layout?)",
            d.tokens, d.first_window, d.end_window, d.tail_end_window
        )));
    }
    check_pieces(plan, &d.pieces, d.first_window, d.end_window)?;
    check_pieces(plan, &d.tail_pieces, d.end_window, d.tail_end_window)
}

/// Whether `pieces` cover exactly windows `[first, end)` of every fragment of `plan`: each
/// inside one fragment's range, none overlapping, as many windows as the ranges hold.
fn check_pieces(
    plan: &LayoutPlan,
    pieces: &[(u64, u64)],
    first: u64,
    end: u64,
) -> Result<(), KvCacheError> {
    let g = plan.granule();
    let stride = plan.slice_stride().max(1);
    let want = mul(
        plan.slice_count(),
        end.saturating_sub(first),
        "prefix windows",
    )?;
    let mut spans: Vec<(u64, u64)> = Vec::with_capacity(pieces.len());
    let mut got = 0u64;
    for &(offset, windows) in pieces {
        let fragment = offset / stride;
        let within = offset - fragment * stride;
        let w = within / g;
        let inside = fragment < plan.slice_count()
            && within.is_multiple_of(g)
            && windows > 0
            && w >= first
            && add(w, windows, "piece end")? <= end;
        if !inside {
            return Err(mismatch(format!(
                "a handle of {windows} windows at offset {offset} is not inside windows \
                 {first}..{end} of a fragment of this plan"
            )));
        }
        spans.push((
            offset,
            add(offset, mul(windows, g, "piece bytes")?, "piece end")?,
        ));
        got = add(got, windows, "prefix windows")?;
    }
    spans.sort_unstable();
    let overlap = spans.windows(2).any(|p| p[1].0 < p[0].1);
    if overlap || got != want {
        return Err(mismatch(format!(
            "the prefix's handles are not windows {first}..{end} of every fragment of this plan \
             ({got} windows for {want})"
        )));
    }
    Ok(())
}

fn mismatch(reason: String) -> KvCacheError {
    KvCacheError::PlanMismatch { reason }
}
