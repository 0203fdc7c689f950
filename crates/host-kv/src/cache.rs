//! [`PagedKvCache`]: one sequence's KV on host pages, with copy-on-write forks.

use std::ops::Range;

use kvvm_layout::{KvGeometry, KvKind};

use kvvm_num::{add, mul, to_usize};

use crate::error::HostKvError;
use crate::store::{HostPageStore, PhysicalPageId};
use crate::table::{PageTable, PageWrite};

/// Where things are inside one page: `[layer][K, V][slot][head][dim]`, so the K (or V) of one
/// layer for all the page's tokens is one contiguous run (what a paged-attention decode
/// reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PageLayout {
    layers: usize,
    tokens_per_page: usize,
    /// Bytes of one token's K (or V) in one layer: `kv_heads x head_dim x dtype_bytes`.
    per_kv: usize,
    /// Bytes of one token: `layers x 2 x per_kv`.
    per_token: usize,
}

impl PageLayout {
    fn new(store: &HostPageStore) -> Result<Self, HostKvError> {
        let g = store.geometry();
        Ok(Self {
            layers: to_usize(u64::from(g.layers()), "layers")?,
            tokens_per_page: store.tokens_per_page(),
            per_kv: to_usize(g.bytes_per_token_per_layer_per_kv(), "bytes per K/V")?,
            per_token: to_usize(g.bytes_per_token(), "bytes per token")?,
        })
    }

    /// Byte offset of the K (`kind == 0`) or V (`kind == 1`) of `layer` for page slot `slot`.
    fn kv_offset(&self, layer: usize, kind: usize, slot: usize) -> Result<usize, HostKvError> {
        let run = add(mul(layer, 2, "page offset")?, kind, "page offset")?;
        let cell = add(
            mul(run, self.tokens_per_page, "page offset")?,
            slot,
            "page offset",
        )?;
        Ok(mul(cell, self.per_kv, "page offset")?)
    }

    /// Byte range of the K or V run of `layer` for slots `0..slots`.
    fn run(&self, layer: usize, kind: usize, slots: usize) -> Result<Range<usize>, HostKvError> {
        let start = self.kv_offset(layer, kind, 0)?;
        Ok(start..add(start, mul(slots, self.per_kv, "run bytes")?, "run end")?)
    }

    /// Scatters one token (`[layer][K, V][head][dim]`) into `page` at `slot`.
    fn scatter(&self, page: &mut [u8], slot: usize, token: &[u8]) -> Result<(), HostKvError> {
        for (i, src) in token.chunks_exact(self.per_kv).enumerate() {
            let at = self.kv_offset(i / 2, i % 2, slot)?;
            let dst = page
                .get_mut(at..add(at, self.per_kv, "page offset")?)
                .ok_or(HostKvError::Overflow { what: "page slice" })?;
            dst.copy_from_slice(src);
        }
        Ok(())
    }

    /// Gathers the token at `slot` of `page` into `out` (`[layer][K, V][head][dim]`).
    fn gather(&self, page: &[u8], slot: usize, out: &mut [u8]) -> Result<(), HostKvError> {
        for (i, dst) in out.chunks_exact_mut(self.per_kv).enumerate() {
            let at = self.kv_offset(i / 2, i % 2, slot)?;
            let src = page
                .get(at..add(at, self.per_kv, "page offset")?)
                .ok_or(HostKvError::Overflow { what: "page slice" })?;
            dst.copy_from_slice(src);
        }
        Ok(())
    }
}

/// One sequence's KV cache on host pages of a [`HostPageStore`], with true copy-on-write
/// forks.
///
/// Tokens are appended one at a time (or several) as `bytes_per_token` bytes ordered
/// `[layer][K, V][kv_head][head_dim]` (the K and V of every layer of that token), up to the
/// geometry's `max_tokens`. [`fork`](Self::fork) makes a second sequence that shares every
/// page (reference-count increments only, no copy). A page is written in place only while
/// this sequence is its sole user: [`append_token`](Self::append_token) goes through
/// [`ensure_page_for_write`](Self::ensure_page_for_write) for the tail page itself, and
/// [`write_token`](Self::write_token) refuses a shared page with
/// [`HostKvError::PageShared`] until `ensure_page_for_write` has copied it. Dropping a cache
/// drops its references; pages no fork uses any more return to the store.
///
/// `PagedKvCache` is `Send + Sync`: a fork can move to another thread; reads take `&self`,
/// writes `&mut self`.
#[derive(Debug)]
pub struct PagedKvCache {
    store: HostPageStore,
    geometry: KvGeometry,
    layout: PageLayout,
    table: PageTable,
    len: u64,
}

impl PagedKvCache {
    /// An empty sequence of `geometry` (its `max_tokens` caps the sequence) on `store`'s
    /// pages.
    ///
    /// Errors: [`HostKvError::GeometryMismatch`] when `geometry` does not have the store's
    /// per-token shape.
    pub fn new(store: &HostPageStore, geometry: KvGeometry) -> Result<Self, HostKvError> {
        let sg = store.geometry();
        if !sg.same_shape(&geometry) {
            let shape = |g: &KvGeometry| (g.layers(), g.kv_heads(), g.head_dim(), g.dtype_bytes());
            return Err(HostKvError::GeometryMismatch {
                store: shape(sg),
                cache: shape(&geometry),
            });
        }
        Ok(Self {
            store: store.clone(),
            geometry,
            layout: PageLayout::new(store)?,
            table: PageTable::new(),
            len: 0,
        })
    }

    /// The sequence's geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// The store the pages come from.
    pub fn store(&self) -> &HostPageStore {
        &self.store
    }

    /// Tokens held.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether no token is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tokens per page.
    pub fn tokens_per_page(&self) -> usize {
        self.layout.tokens_per_page
    }

    /// Logical pages mapped (`ceil(len / tokens_per_page)`).
    pub fn page_count(&self) -> usize {
        self.table.len()
    }

    /// The page table (physical pages and reference counts).
    pub fn page_table(&self) -> &PageTable {
        &self.table
    }

    /// The logical page holding `token` and the token's slot in it.
    pub fn locate(&self, token: u64) -> Result<(usize, usize), HostKvError> {
        if token >= self.len {
            return Err(HostKvError::TokenOutOfRange {
                token,
                len: self.len,
            });
        }
        let token = to_usize(token, "token index")?;
        let tpp = self.layout.tokens_per_page;
        Ok((token / tpp, token % tpp))
    }

    /// A new sequence sharing every page of this one: one reference-count increment per
    /// page, no copy. Both sequences then diverge by copy-on-write.
    pub fn fork(&self) -> PagedKvCache {
        PagedKvCache {
            store: self.store.clone(),
            geometry: self.geometry,
            layout: self.layout,
            table: self.table.fork(),
            len: self.len,
        }
    }

    /// Makes `logical_page` writable by this sequence alone, copying it only when its
    /// reference count is above one (see [`PageTable::ensure_page_for_write`]).
    pub fn ensure_page_for_write(&mut self, logical_page: usize) -> Result<PageWrite, HostKvError> {
        self.table.ensure_page_for_write(logical_page, &self.store)
    }

    /// [`ensure_page_for_write`](Self::ensure_page_for_write) for the page holding `token`.
    pub fn ensure_token_for_write(&mut self, token: u64) -> Result<PageWrite, HostKvError> {
        let (page, _) = self.locate(token)?;
        self.ensure_page_for_write(page)
    }

    fn check_token_bytes(&self, got: usize) -> Result<(), HostKvError> {
        if got == self.layout.per_token {
            Ok(())
        } else {
            Err(HostKvError::WrongTokenBytes {
                expected: self.geometry.bytes_per_token(),
                got: got as u64,
            })
        }
    }

    /// Appends one token (`bytes_per_token` bytes, `[layer][K, V][kv_head][head_dim]`) and
    /// returns its index. Opens a new page when the tail page is full; otherwise makes the
    /// tail page private first (it is still shared right after a fork).
    ///
    /// Errors: [`HostKvError::WrongTokenBytes`], [`HostKvError::CapacityExceeded`], the
    /// store's allocation errors. The sequence is unchanged on error.
    pub fn append_token(&mut self, token: &[u8]) -> Result<u64, HostKvError> {
        self.check_token_bytes(token.len())?;
        if self.len >= self.geometry.max_tokens() {
            return Err(HostKvError::CapacityExceeded {
                len: self.len,
                max_tokens: self.geometry.max_tokens(),
            });
        }
        let index = to_usize(self.len, "token index")?;
        let tpp = self.layout.tokens_per_page;
        let (page, slot) = (index / tpp, index % tpp);
        if slot == 0 {
            self.table.push(self.store.allocate()?);
        } else {
            self.table.ensure_page_for_write(page, &self.store)?;
        }
        let layout = self.layout;
        let written = self
            .table
            .page_mut(page)
            .and_then(|bytes| layout.scatter(bytes, slot, token));
        if let Err(e) = written {
            if slot == 0 {
                self.table.truncate(page);
            }
            return Err(e);
        }
        let at = self.len;
        self.len += 1;
        Ok(at)
    }

    /// Appends whole tokens (`n x bytes_per_token` bytes) and returns their index range.
    /// All or nothing: on error the sequence is as before.
    pub fn append_tokens(&mut self, tokens: &[u8]) -> Result<Range<u64>, HostKvError> {
        let per_token = self.layout.per_token;
        if !tokens.len().is_multiple_of(per_token) {
            return Err(HostKvError::WrongTokenBytes {
                expected: self.geometry.bytes_per_token(),
                got: tokens.len() as u64,
            });
        }
        let count = (tokens.len() / per_token) as u64;
        let start = self.len;
        let end = start.checked_add(count).ok_or(HostKvError::Overflow {
            what: "token count",
        })?;
        if end > self.geometry.max_tokens() {
            return Err(HostKvError::CapacityExceeded {
                len: self.len,
                max_tokens: self.geometry.max_tokens(),
            });
        }
        for token in tokens.chunks_exact(per_token) {
            if let Err(e) = self.append_token(token) {
                self.truncate(start);
                return Err(e);
            }
        }
        Ok(start..end)
    }

    /// Copies token `token` (`[layer][K, V][kv_head][head_dim]`) into `out`, which must be
    /// `bytes_per_token` long.
    pub fn read_token(&self, token: u64, out: &mut [u8]) -> Result<(), HostKvError> {
        self.check_token_bytes(out.len())?;
        let (page, slot) = self.locate(token)?;
        let page = self.page_bytes(page)?;
        self.layout.gather(page, slot, out)
    }

    /// Token `token` as a new `Vec` (see [`read_token`](Self::read_token)).
    pub fn token_to_vec(&self, token: u64) -> Result<Vec<u8>, HostKvError> {
        let mut out = vec![0; self.layout.per_token];
        self.read_token(token, &mut out)?;
        Ok(out)
    }

    /// The K or V of `layer` for token `token`: `kv_heads x head_dim x dtype_bytes` bytes,
    /// borrowed from the page.
    pub fn token_kv(&self, token: u64, layer: u32, kind: KvKind) -> Result<&[u8], HostKvError> {
        self.geometry.check_layer(layer)?;
        let (page, slot) = self.locate(token)?;
        let at = self
            .layout
            .kv_offset(layer as usize, kind.index() as usize, slot)?;
        let end = add(at, self.layout.per_kv, "page offset")?;
        self.page_bytes(page)?
            .get(at..end)
            .ok_or(HostKvError::Overflow { what: "page slice" })
    }

    /// Overwrites token `token` in place.
    ///
    /// Errors: [`HostKvError::TokenOutOfRange`], [`HostKvError::WrongTokenBytes`], and
    /// [`HostKvError::PageShared`] when its page is still shared with another fork: call
    /// [`ensure_page_for_write`](Self::ensure_page_for_write) (or
    /// [`ensure_token_for_write`](Self::ensure_token_for_write)) first.
    pub fn write_token(&mut self, token: u64, bytes: &[u8]) -> Result<(), HostKvError> {
        self.check_token_bytes(bytes.len())?;
        let (page, slot) = self.locate(token)?;
        let layout = self.layout;
        let page = self.table.page_mut(page)?;
        layout.scatter(page, slot, bytes)
    }

    /// Overwrites the K or V of `layer` for token `token` in place (`kv_heads x head_dim x
    /// dtype_bytes` bytes); same errors as [`write_token`](Self::write_token).
    pub fn write_token_kv(
        &mut self,
        token: u64,
        layer: u32,
        kind: KvKind,
        bytes: &[u8],
    ) -> Result<(), HostKvError> {
        self.geometry.check_layer(layer)?;
        if bytes.len() != self.layout.per_kv {
            return Err(HostKvError::WrongTokenBytes {
                expected: self.geometry.bytes_per_token_per_layer_per_kv(),
                got: bytes.len() as u64,
            });
        }
        let (page, slot) = self.locate(token)?;
        let at = self
            .layout
            .kv_offset(layer as usize, kind.index() as usize, slot)?;
        let end = add(at, self.layout.per_kv, "page offset")?;
        let page = self.table.page_mut(page)?;
        page.get_mut(at..end)
            .ok_or(HostKvError::Overflow { what: "page slice" })?
            .copy_from_slice(bytes);
        Ok(())
    }

    /// Keeps the first `len` tokens (no-op when `len >= self.len()`); pages past the new end
    /// are released (returned to the store when no other fork maps them).
    pub fn truncate(&mut self, len: u64) {
        if len >= self.len {
            return;
        }
        let tpp = self.layout.tokens_per_page as u64;
        let pages = len.div_ceil(tpp);
        // `pages <= table.len()`, which is a usize.
        self.table
            .truncate(usize::try_from(pages).unwrap_or(usize::MAX));
        self.len = len;
    }

    /// The sequence's pages in order, each with the token range it holds: what a CPU
    /// paged-attention decode walks.
    pub fn pages(&self) -> PageIter<'_> {
        PageIter {
            cache: self,
            next: 0,
        }
    }

    fn page_bytes(&self, page: usize) -> Result<&[u8], HostKvError> {
        self.table
            .page(page)
            .map(|p| p.data())
            .ok_or(HostKvError::LogicalPageOutOfRange {
                page,
                pages: self.table.len(),
            })
    }
}

/// One page of a sequence as seen by a decode: the tokens it holds and borrowed slices of
/// their K and V per layer.
#[derive(Debug, Clone, Copy)]
pub struct PageView<'a> {
    logical_page: usize,
    physical_page: PhysicalPageId,
    first_token: u64,
    tokens: usize,
    data: &'a [u8],
    layout: PageLayout,
    layers: u32,
}

impl<'a> PageView<'a> {
    /// Index of the page in the sequence.
    pub fn logical_page(&self) -> usize {
        self.logical_page
    }

    /// The physical page (shared pages of forks have the same id).
    pub fn physical_page(&self) -> PhysicalPageId {
        self.physical_page
    }

    /// The sequence's token indices held by this page.
    pub fn tokens(&self) -> Range<u64> {
        self.first_token..self.first_token + self.tokens as u64
    }

    /// Number of tokens held by this page (`1..=tokens_per_page`).
    pub fn token_count(&self) -> usize {
        self.tokens
    }

    /// The K (or V) of `layer` for this page's tokens: `token_count` consecutive vectors of
    /// `kv_heads x head_dim` elements (token-major, heads in order), borrowed from the page.
    ///
    /// Errors: [`HostKvError::Geometry`] for a layer out of range.
    pub fn kv(&self, layer: u32, kind: KvKind) -> Result<&'a [u8], HostKvError> {
        if layer >= self.layers {
            return Err(kvvm_layout::KvError::LayerOutOfRange {
                layer,
                layers: self.layers,
            }
            .into());
        }
        let run = self
            .layout
            .run(layer as usize, kind.index() as usize, self.tokens)?;
        self.data
            .get(run)
            .ok_or(HostKvError::Overflow { what: "page slice" })
    }

    /// The keys of `layer` for this page's tokens (see [`kv`](Self::kv)).
    pub fn keys(&self, layer: u32) -> Result<&'a [u8], HostKvError> {
        self.kv(layer, KvKind::Key)
    }

    /// The values of `layer` for this page's tokens (see [`kv`](Self::kv)).
    pub fn values(&self, layer: u32) -> Result<&'a [u8], HostKvError> {
        self.kv(layer, KvKind::Value)
    }
}

/// Iterator over a sequence's pages ([`PagedKvCache::pages`]).
#[derive(Debug, Clone)]
pub struct PageIter<'a> {
    cache: &'a PagedKvCache,
    next: usize,
}

impl<'a> Iterator for PageIter<'a> {
    type Item = PageView<'a>;

    fn next(&mut self) -> Option<Self::Item> {
        let cache = self.cache;
        let page = cache.table.page(self.next)?;
        let tpp = cache.layout.tokens_per_page as u64;
        let first = (self.next as u64).checked_mul(tpp)?;
        let tokens = cache.len.checked_sub(first)?.min(tpp);
        let view = PageView {
            logical_page: self.next,
            physical_page: page.id(),
            first_token: first,
            tokens: usize::try_from(tokens).ok()?,
            data: page.data(),
            layout: cache.layout,
            layers: cache.geometry.layers(),
        };
        self.next += 1;
        Some(view)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.cache.table.len().saturating_sub(self.next);
        (left, Some(left))
    }
}

impl ExactSizeIterator for PageIter<'_> {}
