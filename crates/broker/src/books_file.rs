//! [`BooksFile`]: what a broker has lent, per tenant and device, kept in a file
//! ([`BrokerConfig::books_path`](crate::BrokerConfig::books_path)) for the broker started
//! after it. That broker keeps those bytes for the claims of the clients that hold them
//! ([`NodeBooks::keep_for_claims`](crate::NodeBooks::keep_for_claims)), so nothing is granted
//! twice while they reconnect, whether the first one stopped or was killed.
//!
//! The file is rewritten in place after every change of what is lent and before the change
//! is answered, so it never says less than clients may hold (one small write at its start,
//! then a truncation: what a crash between the two leaves after the `end` line is ignored;
//! no rename, which some file systems make wait for the disk). A clean stop with nothing
//! lent removes it. The text: a first line `kvvm-broker-lent/1`, one line per (tenant,
//! device) `<tenant> <device> <bytes>`, and `end`.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::BrokerError;
use crate::proto::valid_tenant;

/// The first line of the file, with its version.
const TAG: &str = "kvvm-broker-lent/1";

/// The last line of the file.
const END: &str = "end";

/// What is lent, per (tenant, device).
pub type Lent = BTreeMap<(String, u32), u64>;

/// The file and what it says now.
#[derive(Debug)]
pub struct BooksFile {
    path: PathBuf,
    /// The file, once written to.
    file: Option<File>,
    written: Lent,
    /// Whether the last write failed (logged once until one succeeds).
    failing: bool,
}

fn parse(text: &str) -> Option<Lent> {
    let mut lines = text.lines();
    if lines.next() != Some(TAG) {
        return None;
    }
    let mut lent = Lent::new();
    for line in lines {
        if line == END {
            return Some(lent);
        }
        let mut w = line.split(' ');
        let (tenant, device, bytes) = (w.next()?, w.next()?, w.next()?);
        if w.next().is_some() || !valid_tenant(tenant) {
            return None;
        }
        let key = (tenant.to_owned(), device.parse().ok()?);
        lent.insert(key, bytes.parse().ok()?);
    }
    None
}

fn render(lent: &Lent) -> String {
    let mut out = format!("{TAG}\n");
    for ((tenant, device), bytes) in lent {
        out.push_str(&format!("{tenant} {device} {bytes}\n"));
    }
    out.push_str(END);
    out.push('\n');
    out
}

impl BooksFile {
    /// Opens the file at `path`: what a previous broker had lent (empty when there is no
    /// file: nothing was).
    ///
    /// # Errors
    /// [`BrokerError::Path`] when the file cannot be read or is not one a broker wrote (it
    /// is not guessed at: remove it if no client holds memory of an earlier broker).
    pub fn open(path: &Path) -> Result<(BooksFile, Lent), BrokerError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => Some(t),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(BrokerError::path("the books file", path, e)),
        };
        let lent = match text {
            None => Lent::new(),
            Some(t) => parse(&t).ok_or_else(|| {
                let why = "not a broker's books file (remove it if no client holds memory \
                           lent by an earlier broker)";
                BrokerError::path("the books file", path, io::Error::other(why))
            })?,
        };
        let file = BooksFile {
            path: path.to_owned(),
            file: None,
            written: lent.clone(),
            failing: false,
        };
        Ok((file, lent))
    }

    /// Writes `lent` if it differs from what the file says.
    ///
    /// # Errors
    /// The write's (the file may then say less than what is lent until a write succeeds).
    pub fn write(&mut self, lent: &Lent) -> io::Result<()> {
        if *lent == self.written {
            return Ok(());
        }
        if self.file.is_none() {
            let f = File::options()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&self.path)?;
            self.file = Some(f);
        }
        let text = render(lent);
        if let Some(f) = &self.file {
            f.write_all_at(text.as_bytes(), 0)?;
            f.set_len(text.len() as u64)?;
        }
        self.written.clone_from(lent);
        Ok(())
    }

    /// At a clean stop: the file is removed if nothing is lent (a broker started later has
    /// nothing to keep).
    pub fn close(&mut self) {
        if self.written.is_empty() {
            self.file = None;
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// [`write`](Self::write), a failure logged (once, until a write succeeds again).
    pub fn write_logged(&mut self, lent: &Lent) {
        match self.write(lent) {
            Ok(()) => self.failing = false,
            Err(e) if !self.failing => {
                self.failing = true;
                tracing::error!(error = %e, path = %self.path.display(),
                    "the books file cannot be written: a broker started after this one will not \
                     know what it lent");
            }
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("kvvm-books-{}-{name}", std::process::id()))
    }

    #[test]
    fn what_is_written_is_read_back_and_nothing_lent_leaves_no_file() {
        let p = path("round");
        let (mut f, lent) = BooksFile::open(&p).unwrap();
        assert!(lent.is_empty(), "no file: nothing lent");
        let lent = Lent::from([(("a".into(), 0), 10), (("b.2".into(), 3), u64::MAX)]);
        f.write(&lent).unwrap();
        assert_eq!(BooksFile::open(&p).unwrap().1, lent);
        let less = Lent::from([(("a".into(), 0), 9)]);
        f.write(&less).unwrap();
        assert_eq!(
            BooksFile::open(&p).unwrap().1,
            less,
            "shorter: the rest cut off"
        );
        f.write(&Lent::new()).unwrap();
        assert!(BooksFile::open(&p).unwrap().1.is_empty());
        f.close();
        assert!(!p.exists(), "nothing lent at a clean stop: no file");
        std::fs::write(
            &p,
            "kvvm-broker-lent/1\na 0 1\nend\nb 0 5 what a crash left",
        )
        .unwrap();
        let read = BooksFile::open(&p).unwrap().1;
        assert_eq!(
            read,
            Lent::from([(("a".into(), 0), 1)]),
            "after `end`: ignored"
        );
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn a_file_a_broker_did_not_write_is_refused_with_its_path() {
        let p = path("bad");
        for text in [
            "",
            "kvvm-broker-lent/2\n",
            "kvvm-broker-lent/1\na 0\nend\n",
            "kvvm-broker-lent/1\na 0 1\n",
            "kvvm-broker-lent/1\na 0 1 2\nend\n",
            "kvvm-broker-lent/1\n../x 0 1\nend\n",
            "kvvm-broker-lent/1\na -1 1\nend\n",
        ] {
            std::fs::write(&p, text).unwrap();
            let e = BooksFile::open(&p).unwrap_err().to_string();
            assert!(e.contains(&p.display().to_string()), "{text:?}: {e}");
        }
        std::fs::remove_file(&p).unwrap();
    }
}
