//! Copies between the host and a [`SequenceKv`]: tokens in the host layout
//! `[layer][K, V][kv_head][head_dim]` scattered to (and gathered from) the layout's offsets
//! with one copy per contiguous device run, refused before any driver call when they would
//! write into a read-only shared prefix or touch windows not committed.

use std::sync::Arc;

use kvvm_hal::{DeviceAddress, VirtualMemoryBackend};
use kvvm_num::{add, mul, to_usize};

use crate::error::KvCacheError;
use crate::sequence::{SequenceKv, MAX_COPY_BYTES};

impl SequenceKv {
    fn check_access(&self, first: u64, len: usize) -> Result<(u64, u64), KvCacheError> {
        let bpt = self.plan.geometry().bytes_per_token();
        let len = len as u64;
        if bpt == 0 || !len.is_multiple_of(bpt) {
            return Err(KvCacheError::BadLength {
                expected: len.div_ceil(bpt.max(1)).saturating_mul(bpt),
                got: len,
            });
        }
        let n = len / bpt;
        self.check_not_forgotten(first)?;
        let end = add(first, n, "token range end")?;
        if end > self.committed_tokens {
            return Err(KvCacheError::NotCommitted {
                first,
                end,
                committed: self.committed_tokens,
            });
        }
        Ok((n, end))
    }

    /// Writes one token's KV (`bytes_per_token` bytes, host layout
    /// `[layer][K, V][kv_head][head_dim]`) at the layout's offsets.
    pub fn write_token(&mut self, token: u64, bytes: &[u8]) -> Result<(), KvCacheError> {
        self.write_tokens(token, bytes)
    }

    /// Writes tokens `first..first + n` (`src.len() = n x bytes_per_token`, host layout per
    /// token `[layer][K, V][kv_head][head_dim]`) at the layout's offsets: one copy per
    /// contiguous device run (per fragment; adjacent runs are merged).
    ///
    /// Refused before any driver call: tokens not committed ([`KvCacheError::NotCommitted`]);
    /// a token with a byte in the read-only shared prefix
    /// ([`KvCacheError::WriteIntoSharedPrefix`]). A sharer holds the prefix's tokens before
    /// it writes its own (`SharedDevicePrefix::attach_to` copies those past the read-only
    /// windows), so no token it writes touches them.
    pub fn write_tokens(&mut self, first: u64, src: &[u8]) -> Result<(), KvCacheError> {
        let (n, end) = self.check_access(first, src.len())?;
        if n == 0 {
            return Ok(());
        }
        let g = self.plan.granule();
        let bpt_f = self.plan.fragment_bytes_per_token();
        let protected = mul(self.protected_windows(), g, "protected bytes")?;
        if mul(first, bpt_f, "token offset")? < protected {
            return Err(KvCacheError::WriteIntoSharedPrefix {
                token: first,
                shared_tokens: self.shared_tokens(),
            });
        }
        let span = tracing::debug_span!("kv.write_tokens", first, n);
        let _e = span.enter();
        self.transfer(first, end, Dir::Write(src))?;
        if first <= self.written_tokens {
            self.written_tokens = self.written_tokens.max(end);
        }
        Ok(())
    }

    /// Records that tokens `0..tokens` hold their data although they were not written with
    /// [`write_tokens`](Self::write_tokens): a model wrote them through a tensor view of the
    /// sequence's memory, on the device. What is published from a prefix cache
    /// ([`PrefixCache::publish`](crate::PrefixCache::publish)) must be written; the caller
    /// vouches for the content and for the device having finished writing it (on one stream,
    /// a later reader is ordered after it).
    ///
    /// Errors: [`KvCacheError::NotCommitted`] when `tokens` are not all committed.
    pub fn mark_written(&mut self, tokens: u64) -> Result<(), KvCacheError> {
        if tokens > self.committed_tokens {
            return Err(KvCacheError::NotCommitted {
                first: 0,
                end: tokens,
                committed: self.committed_tokens,
            });
        }
        self.written_tokens = self.written_tokens.max(tokens);
        Ok(())
    }

    /// Reads one token's KV into `out` (`bytes_per_token` bytes, host layout as for
    /// [`write_token`](Self::write_token)).
    pub fn read_token(&self, token: u64, out: &mut [u8]) -> Result<(), KvCacheError> {
        self.read_tokens(token, out)
    }

    /// Reads tokens `first..first + n` into `out` (`n x bytes_per_token` bytes), shared
    /// prefix included, with one copy per contiguous device run.
    pub fn read_tokens(&self, first: u64, out: &mut [u8]) -> Result<(), KvCacheError> {
        let (n, end) = self.check_access(first, out.len())?;
        if n == 0 {
            return Ok(());
        }
        let span = tracing::debug_span!("kv.read_tokens", first, n);
        let _e = span.enter();
        self.transfer(first, end, Dir::Read(out))
    }

    /// Moves the bytes of tokens `first..end` between the host buffer and the device.
    fn transfer(&self, first: u64, end: u64, mut dir: Dir<'_>) -> Result<(), KvCacheError> {
        let backend: &Arc<dyn VirtualMemoryBackend> = self.vm.backend();
        let base = self.reservation.address();
        let bpt = self.plan.geometry().bytes_per_token();
        let bpt_f = self.plan.fragment_bytes_per_token();
        let lo = mul(first, bpt_f, "device range")?;
        let hi = mul(end, bpt_f, "device range")?;
        if lo >= hi {
            return Ok(());
        }
        // Token-major with one fragment: host and device orders coincide.
        if let [f] = self.fragments.as_slice() {
            return self.transfer_contiguous(f.offset, first, lo, hi, &mut dir);
        }
        let mut staging: Vec<u8> = Vec::new();
        let mut flush = |run_start: u64, run: &[(usize, u64, u64)]| {
            self.flush(
                backend,
                base,
                run_start,
                run,
                first,
                bpt,
                bpt_f,
                &mut staging,
                &mut dir,
            )
        };
        // Runs of adjacent device bytes, each a list of (fragment, device lo, device hi).
        let mut run: Vec<(usize, u64, u64)> = Vec::new();
        let mut run_start = 0u64;
        let mut run_end = 0u64;
        let mut run_bytes = 0u64;
        for (i, f) in self.fragments.iter().enumerate() {
            let start = add(f.offset, lo, "device offset")?;
            let stop = add(f.offset, hi, "device offset")?;
            let len = stop - start;
            let adjacent = !run.is_empty() && start == run_end;
            if !run.is_empty()
                && (!adjacent || run_bytes.saturating_add(len) > MAX_COPY_BYTES as u64)
            {
                flush(run_start, &run)?;
                run.clear();
                run_bytes = 0;
            }
            if run.is_empty() {
                run_start = start;
            }
            run.push((i, lo, hi));
            run_end = stop;
            run_bytes = run_bytes.saturating_add(len);
        }
        if !run.is_empty() {
            flush(run_start, &run)?;
        }
        Ok(())
    }

    /// [`transfer`](Self::transfer) for one fragment, where the host and device orders
    /// coincide: device bytes `lo..hi` of the fragment at `fragment_offset`, in copies of at
    /// most `MAX_COPY_BYTES`.
    fn transfer_contiguous(
        &self,
        fragment_offset: u64,
        first: u64,
        lo: u64,
        hi: u64,
        dir: &mut Dir<'_>,
    ) -> Result<(), KvCacheError> {
        let backend: &Arc<dyn VirtualMemoryBackend> = self.vm.backend();
        let base = self.reservation.address();
        let bpt_f = self.plan.fragment_bytes_per_token();
        let skip = to_usize(lo - mul(first, bpt_f, "device range")?, "usize")?;
        let mut dev = add(fragment_offset, lo, "device offset")?;
        let total = to_usize(hi - lo, "usize")?;
        let mut done = 0usize;
        while done < total {
            let len = (total - done).min(MAX_COPY_BYTES);
            let addr = base.checked_add(dev).ok_or(crate::KvError::Overflow {
                what: "device address",
            })?;
            match dir {
                Dir::Write(src) => {
                    backend.copy_to_device(addr, &src[skip + done..skip + done + len])?
                }
                Dir::Read(out) => {
                    backend.copy_from_device(&mut out[skip + done..skip + done + len], addr)?
                }
            }
            done += len;
            dev = add(dev, len as u64, "device offset")?;
        }
        Ok(())
    }

    /// One copy of a run: gather (write) or scatter (read) through `staging`.
    #[allow(clippy::too_many_arguments)]
    fn flush(
        &self,
        backend: &Arc<dyn VirtualMemoryBackend>,
        base: DeviceAddress,
        run_start: u64,
        run: &[(usize, u64, u64)],
        first: u64,
        bpt: u64,
        bpt_f: u64,
        staging: &mut Vec<u8>,
        dir: &mut Dir<'_>,
    ) -> Result<(), KvCacheError> {
        let addr = base
            .checked_add(run_start)
            .ok_or(crate::KvError::Overflow {
                what: "device address",
            })?;
        let total: u64 = run.iter().map(|&(_, lo, hi)| hi - lo).sum();
        staging.clear();
        staging.resize(to_usize(total, "usize")?, 0);
        // (host offset, staging offset, len) of every piece, in device order.
        let pieces = |f: usize,
                      lo: u64,
                      hi: u64,
                      mut at: usize,
                      cb: &mut dyn FnMut(usize, usize, usize)|
         -> Result<usize, KvCacheError> {
            let frag_in_token = mul(f as u64, bpt_f, "host offset")?;
            let mut x = lo;
            while x < hi {
                let t = x / bpt_f;
                let within = x % bpt_f;
                let piece_end = (mul(t + 1, bpt_f, "piece end")?).min(hi);
                let len = to_usize(piece_end - x, "usize")?;
                let host = add(
                    mul(t - first, bpt, "host offset")?,
                    add(frag_in_token, within, "host offset")?,
                    "host offset",
                )?;
                cb(to_usize(host, "usize")?, at, len);
                at += len;
                x = piece_end;
            }
            Ok(at)
        };
        match dir {
            Dir::Write(src) => {
                let mut at = 0usize;
                for &(f, lo, hi) in run {
                    let st = &mut *staging;
                    at = pieces(f, lo, hi, at, &mut |h, s, l| {
                        st[s..s + l].copy_from_slice(&src[h..h + l]);
                    })?;
                }
                backend.copy_to_device(addr, staging)?;
            }
            Dir::Read(out) => {
                backend.copy_from_device(staging, addr)?;
                let mut at = 0usize;
                for &(f, lo, hi) in run {
                    let st = &*staging;
                    let o = &mut **out;
                    at = pieces(f, lo, hi, at, &mut |h, s, l| {
                        o[h..h + l].copy_from_slice(&st[s..s + l]);
                    })?;
                }
            }
        }
        Ok(())
    }
}

enum Dir<'a> {
    Write(&'a [u8]),
    Read(&'a mut [u8]),
}
