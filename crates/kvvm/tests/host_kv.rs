//! The host paged KV cache through the facade (`kvvm::host_kv`): a fork shares every page, the
//! first write into a shared page copies that page only, and the store gets every page back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvvm::host_kv::{HostKvError, HostPageStore, PageWrite, PagedKvCache};
use kvvm::layout::KvGeometry;

#[test]
fn a_fork_through_the_facade_shares_pages_and_copies_on_write() -> Result<(), HostKvError> {
    // 2 layers x 2 KV heads x head_dim 4, fp16: 64 bytes per token; 16 tokens a page.
    let geometry = KvGeometry::new(2, 2, 4, 2, 1024).unwrap();
    let store = HostPageStore::new(geometry, 16)?;
    let mut parent = PagedKvCache::new(&store, geometry)?;
    parent.append_tokens(&[7u8; 64 * 40])?; // 40 tokens: 3 pages
    assert_eq!(store.live_pages(), 3);

    let mut child = parent.fork();
    assert_eq!(store.live_pages(), 3, "a fork copies no page");
    assert!(matches!(
        child.write_token(20, &[1; 64]),
        Err(HostKvError::PageShared { .. })
    ));
    assert!(matches!(
        child.ensure_token_for_write(20)?,
        PageWrite::Copied { .. }
    ));
    assert_eq!(store.live_pages(), 4, "the written page alone was copied");
    child.write_token(20, &[1; 64])?;
    assert_eq!(child.token_to_vec(20)?, vec![1; 64]);
    assert_eq!(
        parent.token_to_vec(20)?,
        vec![7; 64],
        "the parent is unchanged"
    );

    drop(parent);
    drop(child);
    assert_eq!(store.live_pages(), 0);
    Ok(())
}
