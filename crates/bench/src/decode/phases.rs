//! The decode loop's phases ([`run_decode_loop`](super::run_decode_loop) runs them in
//! order): prefill, decode, verify, then attach vs copy, each timed and counted for the
//! report.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvvm::hal::VirtualMemoryBackend;
use kvvm::kv::synthetic::{decode_token_id, fill_tokens, prompt_token_id};
use kvvm::kv::{KvCacheError, PrefixCache, PrefixCacheStats, SequenceKv, SharedDevicePrefix};
use kvvm::layout::{KvGeometry, LayoutPlan, PrefixShareability};
use kvvm::num::{mul, to_usize};
use kvvm::vmm::VirtualMemory;

use super::{DecodeLoopConfig, DecodeLoopReport, LoopProgress};

/// Host bytes per verification / write chunk.
const CHUNK_BYTES: u64 = 64 << 20;

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn compare(
    sequence: u64,
    first: u64,
    bpt: u64,
    expected: &[u8],
    got: &[u8],
) -> Result<(), KvCacheError> {
    if expected == got {
        return Ok(());
    }
    let i = expected
        .iter()
        .zip(got)
        .position(|(a, b)| a != b)
        .unwrap_or(0);
    let i = i as u64;
    Err(KvCacheError::Verification {
        sequence,
        token: first + i / bpt.max(1),
        byte: i % bpt.max(1),
        expected: expected.get(i as usize).copied().unwrap_or(0),
        got: got.get(i as usize).copied().unwrap_or(0),
    })
}

/// The units of work done, reported as [`LoopProgress`].
pub(super) struct Ticker<'p> {
    units: u64,
    total: u64,
    progress: &'p mut dyn FnMut(LoopProgress),
}

impl<'p> Ticker<'p> {
    /// A ticker over every unit of the run of `config`: each sequence's prefill and decode
    /// steps, its verification, and each attach and attach/copy sample.
    pub(super) fn new(
        config: &DecodeLoopConfig,
        progress: &'p mut dyn FnMut(LoopProgress),
    ) -> Self {
        let seqs_n = u64::from(config.sequences);
        let steps = config.decode_tokens.div_ceil(config.step_tokens.max(1));
        let verify_units = if config.verify { seqs_n } else { 0 };
        let total = seqs_n
            .saturating_mul(steps.saturating_add(1))
            .saturating_add(verify_units)
            .saturating_add(u64::from(config.attach_copy_samples))
            .saturating_add(u64::from(config.attach_samples));
        Ticker {
            units: 0,
            total,
            progress,
        }
    }

    /// `n` more units of `phase` done.
    fn tick(&mut self, phase: &'static str, n: u64) {
        self.units = self.units.saturating_add(n);
        (self.progress)(LoopProgress {
            phase,
            done: self.units.min(self.total),
            total: self.total,
        });
    }
}

/// What the phases measured, for the report.
#[derive(Default)]
pub(super) struct Measured {
    /// Time of each admission that hit the cache.
    admit_hits: Vec<Duration>,
    admit_hit_mappings: usize,
    hit_tokens: u64,
    pub(super) prefill_time: Duration,
    pub(super) decode_time: Duration,
    pub(super) verify_time: Duration,
    pub(super) committed_with_sharing: u64,
    pub(super) shared_prefix_bytes: u64,
    pub(super) prefix_tail_bytes: u64,
    pub(super) cache: PrefixCacheStats,
}

/// What the attach-vs-copy phase timed.
pub(super) struct AttachCopy {
    verdict: PrefixShareability,
    copy_bytes: u64,
    attach: Vec<Duration>,
    attach_mappings: usize,
    attach_after_copy: Vec<Duration>,
    copy: Vec<Duration>,
}

/// One decode loop's phases over one manager.
pub(super) struct DecodeLoop<'a> {
    config: &'a DecodeLoopConfig,
    vm: &'a VirtualMemory,
    geometry: KvGeometry,
    plan: LayoutPlan,
    total_tokens: u64,
    bpt: u64,
    /// Tokens per verification / write chunk.
    chunk_tokens: u64,
    prompt_ids: Vec<u32>,
    /// The host bytes of a chunk or a step, reused.
    buf: Vec<u8>,
    bytes_written: u64,
    bytes_verified: u64,
    ticker: Ticker<'a>,
}

impl<'a> DecodeLoop<'a> {
    pub(super) fn new(
        config: &'a DecodeLoopConfig,
        vm: &'a VirtualMemory,
        geometry: KvGeometry,
        plan: LayoutPlan,
        total_tokens: u64,
        ticker: Ticker<'a>,
    ) -> Self {
        let bpt = geometry.bytes_per_token();
        DecodeLoop {
            config,
            vm,
            geometry,
            plan,
            total_tokens,
            bpt,
            chunk_tokens: (CHUNK_BYTES / bpt.max(1)).max(1),
            prompt_ids: (0..config.prompt_tokens).map(prompt_token_id).collect(),
            buf: Vec::new(),
            bytes_written: 0,
            bytes_verified: 0,
            ticker,
        }
    }

    /// The bytes of `n` tokens, as a host buffer length.
    fn chunk_len(&self, n: u64, what: &'static str) -> Result<usize, KvCacheError> {
        Ok(to_usize(mul(n, self.bpt, what)?, "usize")?)
    }

    /// Prefill: sequence 0 is admitted (a miss), writes the prompt and publishes it; every
    /// other sequence is admitted (a hit of the prompt's full blocks), then writes only the
    /// rest of the prompt, and publishes it. Without sharing, every sequence commits and
    /// writes its whole prompt privately.
    pub(super) fn prefill(
        &mut self,
        cache: &PrefixCache,
        m: &mut Measured,
    ) -> Result<Vec<SequenceKv>, KvCacheError> {
        let config = self.config;
        let mut seqs: Vec<SequenceKv> = Vec::with_capacity(config.sequences as usize);
        let mut froms: Vec<u64> = Vec::with_capacity(config.sequences as usize);
        for s in 0..config.sequences {
            let (mut seq, from) = if config.share_prefix {
                self.admit_shared(cache, m)?
            } else {
                let mut seq = SequenceKv::new(self.vm, &self.plan, self.total_tokens)?;
                seq.ensure_tokens(config.prompt_tokens)?;
                (seq, 0)
            };
            if s == 0 && config.share_prefix {
                // The first request writes its prompt and publishes it before anyone else
                // is admitted, so that they hit it.
                self.write_own_prompt(&mut seq, from)?;
                cache.publish(&mut seq)?;
                froms.push(config.prompt_tokens);
            } else {
                froms.push(from);
            }
            seqs.push(seq);
            self.ticker.tick("prefill", 1);
        }
        self.write_prompt_rests(&mut seqs, &froms)?;
        if config.share_prefix {
            for seq in &mut seqs {
                cache.publish(seq)?;
            }
        }
        Ok(seqs)
    }

    /// Admits one sequence through the cache, timing the admissions that hit it. Returns the
    /// sequence and the prompt tokens it found.
    fn admit_shared(
        &self,
        cache: &PrefixCache,
        m: &mut Measured,
    ) -> Result<(SequenceKv, u64), KvCacheError> {
        let t = Instant::now();
        let adm = cache.admit(&self.prompt_ids, self.total_tokens)?;
        if adm.hit_tokens > 0 {
            m.admit_hits.push(t.elapsed());
            m.hit_tokens = adm.hit_tokens;
            if m.admit_hits.len() == 1 {
                m.admit_hit_mappings = adm.sequence.reservation().mappings().len();
            }
        }
        let from = adm.hit_tokens;
        Ok((adm.sequence, from))
    }

    /// Writes the prompt from token `from` into `seq` alone, chunk by chunk.
    fn write_own_prompt(&mut self, seq: &mut SequenceKv, from: u64) -> Result<(), KvCacheError> {
        let prompt = self.config.prompt_tokens;
        let mut t = from;
        while t < prompt {
            let n = self.chunk_tokens.min(prompt - t);
            self.buf.resize(self.chunk_len(n, "chunk")?, 0);
            fill_tokens(&self.geometry, t, &mut self.buf, &prompt_token_id);
            seq.write_tokens(t, &self.buf)?;
            self.bytes_written = self.bytes_written.saturating_add(self.buf.len() as u64);
            t += n;
        }
        Ok(())
    }

    /// Everyone writes the part of the prompt it did not find in the cache (from `froms`);
    /// each chunk of the prompt is generated once and written to every sequence that needs
    /// it.
    fn write_prompt_rests(
        &mut self,
        seqs: &mut [SequenceKv],
        froms: &[u64],
    ) -> Result<(), KvCacheError> {
        let prompt = self.config.prompt_tokens;
        let mut t = 0;
        while t < prompt {
            let n = self.chunk_tokens.min(prompt - t);
            let end = t + n;
            let mut generated = false;
            for (seq, &from) in seqs.iter_mut().zip(froms) {
                let lo = from.max(t);
                if lo >= end {
                    continue;
                }
                if !generated {
                    self.buf.resize(self.chunk_len(n, "chunk")?, 0);
                    fill_tokens(&self.geometry, t, &mut self.buf, &prompt_token_id);
                    generated = true;
                }
                let skip = self.chunk_len(lo - t, "chunk")?;
                seq.write_tokens(lo, &self.buf[skip..])?;
                self.bytes_written = self
                    .bytes_written
                    .saturating_add((self.buf.len() - skip) as u64);
            }
            t = end;
        }
        Ok(())
    }

    /// Decode: in steps of `step_tokens`, each sequence commits (`ensure_tokens`) and writes
    /// its own tokens.
    pub(super) fn decode(&mut self, seqs: &mut [SequenceKv]) -> Result<(), KvCacheError> {
        let step = self.config.step_tokens.max(1);
        let mut len = self.config.prompt_tokens;
        while len < self.total_tokens {
            let n = step.min(self.total_tokens - len);
            self.buf.resize(self.chunk_len(n, "step")?, 0);
            for (s, seq) in seqs.iter_mut().enumerate() {
                seq.ensure_tokens(len + n)?;
                let s = s as u64;
                fill_tokens(&self.geometry, len, &mut self.buf, &|p| {
                    decode_token_id(s, p)
                });
                seq.write_tokens(len, &self.buf)?;
                self.bytes_written = self.bytes_written.saturating_add(self.buf.len() as u64);
            }
            len += n;
            self.ticker.tick("decode", u64::from(self.config.sequences));
        }
        Ok(())
    }

    /// Reads every byte of every sequence back and compares it: the prompt chunk by chunk
    /// (each generated once and compared for every sequence), then each sequence's own
    /// tokens.
    pub(super) fn verify(&mut self, seqs: &[SequenceKv]) -> Result<(), KvCacheError> {
        let mut expected = Vec::new();
        let mut got = Vec::new();
        let prompt = self.config.prompt_tokens;
        let mut t = 0;
        while t < prompt {
            let n = self.chunk_tokens.min(prompt - t);
            expected.resize(self.chunk_len(n, "chunk")?, 0);
            got.resize(expected.len(), 0);
            fill_tokens(&self.geometry, t, &mut expected, &prompt_token_id);
            for (s, seq) in seqs.iter().enumerate() {
                seq.read_tokens(t, &mut got)?;
                compare(s as u64, t, self.bpt, &expected, &got)?;
                self.bytes_verified = self.bytes_verified.saturating_add(got.len() as u64);
            }
            t += n;
        }
        for (s, seq) in seqs.iter().enumerate() {
            self.verify_decoded(s as u64, seq, &mut expected, &mut got)?;
            self.ticker.tick("verify", 1);
        }
        Ok(())
    }

    /// Reads back and compares the tokens sequence `s` decoded, chunk by chunk.
    fn verify_decoded(
        &mut self,
        s: u64,
        seq: &SequenceKv,
        expected: &mut Vec<u8>,
        got: &mut Vec<u8>,
    ) -> Result<(), KvCacheError> {
        let mut t = self.config.prompt_tokens;
        while t < self.total_tokens {
            let n = self.chunk_tokens.min(self.total_tokens - t);
            expected.resize(self.chunk_len(n, "chunk")?, 0);
            got.resize(expected.len(), 0);
            fill_tokens(&self.geometry, t, expected, &|p| decode_token_id(s, p));
            seq.read_tokens(t, got)?;
            compare(s, t, self.bpt, expected, got)?;
            self.bytes_verified = self.bytes_verified.saturating_add(got.len() as u64);
            t += n;
        }
        Ok(())
    }

    /// Attach: the time of `map_shared_prefix_readonly` for the prompt, back to back; then
    /// attach vs copy: an attach right after each copy of the prompt's bytes into a private
    /// sequence (reserve, commit, copy).
    pub(super) fn attach_vs_copy(
        &mut self,
        backend: &dyn VirtualMemoryBackend,
    ) -> Result<AttachCopy, KvCacheError> {
        let config = self.config;
        let verdict = kvvm::layout::evaluate_prefix_shareability(
            &self.geometry,
            config.layout,
            config.prompt_tokens,
            self.plan.granule(),
        )?;
        let copy_bytes = mul(config.prompt_tokens, self.bpt, "copy bytes")?;
        let mut timed = AttachCopy {
            verdict,
            copy_bytes,
            attach: Vec::new(),
            attach_mappings: 0,
            attach_after_copy: Vec::new(),
            copy: Vec::new(),
        };
        if config.attach_copy_samples == 0 || config.prompt_tokens == 0 {
            return Ok(timed);
        }
        let mut host = vec![0u8; to_usize(copy_bytes, "usize")?];
        fill_tokens(&self.geometry, 0, &mut host, &prompt_token_id);
        let owner = if timed.verdict.shareable {
            Some(self.written_prefix(&host)?)
        } else {
            None
        };
        if let Some((prefix, _)) = &owner {
            self.time_attaches(prefix, &mut timed)?;
        }
        for _ in 0..config.attach_copy_samples {
            let prefix = owner.as_ref().map(|(prefix, _)| prefix);
            self.time_attach_and_copy(backend, prefix, &host, &mut timed)?;
        }
        drop(owner);
        Ok(timed)
    }

    /// The prompt as a shared prefix, written from `host` by its owner and sealed.
    fn written_prefix(
        &self,
        host: &[u8],
    ) -> Result<(Arc<SharedDevicePrefix>, SequenceKv), KvCacheError> {
        let (prefix, mut owner) = SharedDevicePrefix::reserve_unwritten(
            self.vm,
            &self.plan,
            self.config.prompt_tokens,
            self.total_tokens,
        )?;
        owner.write_tokens(0, host)?;
        owner.seal_prefix()?;
        Ok((prefix, owner))
    }

    /// Times `attach_samples` attaches of `prefix`, back to back.
    fn time_attaches(
        &mut self,
        prefix: &Arc<SharedDevicePrefix>,
        timed: &mut AttachCopy,
    ) -> Result<(), KvCacheError> {
        for _ in 0..self.config.attach_samples {
            let t = Instant::now();
            let seq = prefix.map_shared_prefix_readonly(self.vm, self.total_tokens)?;
            timed.attach.push(t.elapsed());
            if timed.attach.len() == 1 {
                timed.attach_mappings = seq.reservation().mappings().len();
            }
            drop(seq);
            self.ticker.tick("attach", 1);
        }
        Ok(())
    }

    /// One attach/copy sample: an attach of `prefix` (when shareable), then a copy of the
    /// prompt from `host` into a private sequence (reserve, commit, copy, synchronize).
    fn time_attach_and_copy(
        &mut self,
        backend: &dyn VirtualMemoryBackend,
        prefix: Option<&Arc<SharedDevicePrefix>>,
        host: &[u8],
        timed: &mut AttachCopy,
    ) -> Result<(), KvCacheError> {
        if let Some(prefix) = prefix {
            let t = Instant::now();
            let seq = prefix.map_shared_prefix_readonly(self.vm, self.total_tokens)?;
            timed.attach_after_copy.push(t.elapsed());
            drop(seq);
        }
        let t = Instant::now();
        let mut seq = SequenceKv::new(self.vm, &self.plan, self.total_tokens)?;
        seq.ensure_tokens(self.config.prompt_tokens)?;
        seq.write_tokens(0, host)?;
        backend.synchronize(self.config.device)?;
        timed.copy.push(t.elapsed());
        drop(seq);
        self.ticker.tick("attach vs copy", 1);
        Ok(())
    }

    /// The report of the run (`used_bytes_at_end` left 0: measured once the cache is gone).
    pub(super) fn report(
        &self,
        backend: &str,
        block_tokens: u64,
        mut m: Measured,
        mut timed: AttachCopy,
    ) -> Result<DecodeLoopReport, KvCacheError> {
        let config = self.config;
        let without = if config.share_prefix {
            mul(
                u64::from(config.sequences),
                self.plan.committed_bytes_for_tokens(self.total_tokens)?,
                "committed without sharing",
            )?
        } else {
            m.committed_with_sharing
        };
        let fastest = |v: &[Duration]| v.iter().min().copied().unwrap_or_default();
        Ok(DecodeLoopReport {
            backend: backend.to_owned(),
            model: config.model.clone(),
            layout: config.layout,
            granule: self.plan.granule(),
            sequences: config.sequences,
            prompt_tokens: config.prompt_tokens,
            decode_tokens: config.decode_tokens,
            bytes_per_token: self.bpt,
            share_prefix: config.share_prefix,
            block_tokens,
            prefix_handle_windows: config.prefix_handle_windows.max(1),
            hit_tokens: m.hit_tokens,
            prompt_shareable: timed.verdict.shareable,
            prompt_refusal: timed.verdict.refusal_reason(),
            shared_prefix_bytes: m.shared_prefix_bytes,
            prefix_tail_bytes: m.prefix_tail_bytes,
            committed_bytes_with_sharing: m.committed_with_sharing,
            committed_bytes_without_sharing: without,
            attach_median: median(&mut timed.attach),
            attach_min: fastest(&timed.attach),
            attach_mappings: timed.attach_mappings,
            attach_after_copy_median: median(&mut timed.attach_after_copy),
            attach_after_copy_min: fastest(&timed.attach_after_copy),
            admit_hit_median: median(&mut m.admit_hits),
            admit_hit_mappings: m.admit_hit_mappings,
            copy_median: median(&mut timed.copy),
            copy_min: fastest(&timed.copy),
            copy_bytes: timed.copy_bytes,
            prefill_time: m.prefill_time,
            decode_time: m.decode_time,
            verify_time: m.verify_time,
            bytes_written: self.bytes_written,
            bytes_verified: self.bytes_verified,
            verified: config.verify,
            cache: m.cache,
            used_bytes_at_end: 0,
        })
    }
}
