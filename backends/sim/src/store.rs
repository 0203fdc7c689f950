//! [`ChunkStore`]: the bytes behind one simulated allocation, kept only where a caller wrote
//! them. The simulated device's memory is the host's, so what is stored is bounded by what is
//! written, never by what is allocated or mapped:
//!
//! * memory is cut in chunks of [`CHUNK`] bytes; a chunk nobody wrote is not stored and reads
//!   as zeros (what fresh simulated memory holds);
//! * a chunk whose bytes are all equal is stored as that one byte (a write of zeros over a
//!   whole chunk stores nothing at all); only a chunk of mixed bytes holds [`CHUNK`] bytes of
//!   host memory.
//!
//! [`stored_bytes`](ChunkStore::stored_bytes) is the host memory the data holds: [`CHUNK`]
//! bytes per mixed chunk and one per uniform one.

use std::collections::HashMap;
use std::ops::Range;

/// Data is stored in chunks of this many bytes, on first write.
pub const CHUNK: u64 = 64 * 1024;

/// One stored chunk.
#[derive(Debug)]
enum Chunk {
    /// Every byte is this one (never 0: a zero chunk is not stored).
    Fill(u8),
    /// Mixed bytes, `CHUNK` of them.
    Bytes(Box<[u8]>),
}

impl Chunk {
    /// Host bytes this chunk holds.
    fn stored(&self) -> u64 {
        match self {
            Chunk::Fill(_) => 1,
            Chunk::Bytes(_) => CHUNK,
        }
    }
}

/// The byte every element of `s` equals, if they are all equal. (Each byte equals the next:
/// one slice comparison, a `memcmp`, fast in any build.)
fn uniform(s: &[u8]) -> Option<u8> {
    let first = *s.first()?;
    let n = s.len();
    (s.get(1..) == s.get(..n - 1)).then_some(first)
}

/// The pieces of `len` bytes at `offset` that each lie in one chunk, in order: the chunk's
/// index, where the piece starts in the chunk, and the piece's range in the caller's buffer.
fn pieces(offset: u64, len: usize) -> impl Iterator<Item = (u64, usize, Range<usize>)> {
    let mut done = 0usize;
    std::iter::from_fn(move || {
        if done >= len {
            return None;
        }
        let pos = offset + done as u64;
        let within = (pos % CHUNK) as usize;
        let n = (CHUNK as usize - within).min(len - done);
        let range = done..done + n;
        done += n;
        Some((pos / CHUNK, within, range))
    })
}

/// The written bytes of one allocation (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct ChunkStore {
    chunks: HashMap<u64, Chunk>,
    stored: u64,
}

impl ChunkStore {
    /// Host bytes the data holds now.
    pub(crate) fn stored_bytes(&self) -> u64 {
        self.stored
    }

    /// Forgets every byte (they read as zeros again).
    pub(crate) fn clear(&mut self) {
        self.chunks.clear();
        self.stored = 0;
    }

    fn set(&mut self, index: u64, chunk: Option<Chunk>) {
        let old = match chunk {
            Some(c) => {
                self.stored = self.stored.saturating_add(c.stored());
                self.chunks.insert(index, c)
            }
            None => self.chunks.remove(&index),
        };
        if let Some(old) = old {
            self.stored = self.stored.saturating_sub(old.stored());
        }
    }

    /// Writes `src` at `offset`.
    pub(crate) fn write(&mut self, offset: u64, src: &[u8]) {
        for (index, within, range) in pieces(offset, src.len()) {
            self.write_chunk(index, within, &src[range]);
        }
    }

    /// Writes `piece` at `within` of chunk `index` (it does not cross the chunk's end).
    fn write_chunk(&mut self, index: u64, within: usize, piece: &[u8]) {
        let whole = within == 0 && piece.len() == CHUNK as usize;
        let fill = uniform(piece);
        // What the chunk holds outside the piece: zeros, one byte, or mixed bytes.
        let around = match self.chunks.get(&index) {
            None => Some(0),
            Some(Chunk::Fill(b)) => Some(*b),
            Some(Chunk::Bytes(_)) => None,
        };
        match (fill, around) {
            // The chunk stays (or becomes) uniform: one byte, or nothing for zeros.
            (Some(b), _) if whole => self.set(index, (b != 0).then_some(Chunk::Fill(b))),
            (Some(b), Some(a)) if a == b => {}
            _ => {
                let mut buf = match self.chunks.remove(&index) {
                    Some(Chunk::Bytes(buf)) => {
                        self.stored = self.stored.saturating_sub(CHUNK);
                        buf
                    }
                    Some(Chunk::Fill(b)) => {
                        self.stored = self.stored.saturating_sub(1);
                        vec![b; CHUNK as usize].into_boxed_slice()
                    }
                    None => vec![0u8; CHUNK as usize].into_boxed_slice(),
                };
                buf[within..within + piece.len()].copy_from_slice(piece);
                self.set(index, Some(Chunk::Bytes(buf)));
            }
        }
    }

    /// Reads `dst.len()` bytes at `offset`; bytes never written read as zeros.
    pub(crate) fn read(&self, offset: u64, dst: &mut [u8]) {
        for (index, within, range) in pieces(offset, dst.len()) {
            let out = &mut dst[range];
            match self.chunks.get(&index) {
                None => out.fill(0),
                Some(Chunk::Fill(b)) => out.fill(*b),
                Some(Chunk::Bytes(buf)) => out.copy_from_slice(&buf[within..within + out.len()]),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_bytes_roundtrip_across_chunk_boundaries() {
        let mut data = ChunkStore::default();
        let src: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        data.write(CHUNK - 7, &src);
        let mut back = vec![0u8; src.len()];
        data.read(CHUNK - 7, &mut back);
        assert_eq!(back, src);
        let mut zeros = vec![1u8; 16];
        data.read(40 * CHUNK, &mut zeros);
        assert!(zeros.iter().all(|b| *b == 0));
        // Chunks 0..=4 are touched, each with mixed bytes.
        assert_eq!(data.stored_bytes(), 5 * CHUNK);
    }

    #[test]
    fn only_mixed_chunks_hold_a_chunk_of_host_memory() {
        let mut data = ChunkStore::default();
        // Zeros store nothing, wherever they are written.
        data.write(3, &vec![0u8; 5 * CHUNK as usize]);
        assert_eq!(data.stored_bytes(), 0);
        // A uniform chunk is one byte; a uniform write inside it changes nothing.
        data.write(CHUNK, &vec![9u8; CHUNK as usize]);
        assert_eq!(data.stored_bytes(), 1);
        data.write(CHUNK + 100, &[9u8; 50]);
        assert_eq!(data.stored_bytes(), 1);
        // A different byte inside makes it mixed; its other bytes keep their value.
        data.write(CHUNK + 10, &[4u8; 2]);
        assert_eq!(data.stored_bytes(), CHUNK);
        let mut back = [0u8; 14];
        data.read(CHUNK, &mut back);
        assert_eq!(back, [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 4, 4, 9, 9]);
        // A whole uniform write makes it one byte again; zeros over it forget it.
        data.write(CHUNK, &vec![7u8; CHUNK as usize]);
        assert_eq!(data.stored_bytes(), 1);
        data.write(CHUNK, &vec![0u8; CHUNK as usize]);
        assert_eq!(data.stored_bytes(), 0);
        let mut back = vec![1u8; CHUNK as usize];
        data.read(CHUNK, &mut back);
        assert!(back.iter().all(|b| *b == 0));
        // A partial non-zero write into an unwritten chunk is mixed (the rest is zeros).
        data.write(2 * CHUNK + 1, &[5u8]);
        assert_eq!(data.stored_bytes(), CHUNK);
        let mut back = [9u8; 3];
        data.read(2 * CHUNK, &mut back);
        assert_eq!(back, [0, 5, 0]);
        data.clear();
        assert_eq!(data.stored_bytes(), 0);
    }
}
