//! Cross-process sharing of a prefix through its memfd: this process commits a shared prefix
//! through the manager and exports its handle; a child process (this test binary, re-run)
//! imports the descriptor, maps it read-only and reads the bytes. The memory is freed only
//! after both released: the child still reads the prefix after this process released and
//! unmapped everything it had.
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::os::fd::AsFd;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvvm_governor::Governor;
use kvvm_hal::{
    AccessDescriptor, AllocationProperties, DeviceId, ErrorKind, ShareableHandleType,
    VirtualMemoryBackend,
};
use kvvm_host::HostBackend;
use kvvm_vmm::{VirtualMemory, VmmConfig};

const CHILD_ENV: &str = "KVVM_HOST_TEST_CHILD";
const GO_ENV: &str = "KVVM_HOST_TEST_GO";
const LINE: &str = "KVVM_HOST_CHILD ";

fn prefix_byte(i: usize) -> u8 {
    (i.wrapping_mul(7) ^ (i >> 9)) as u8
}

fn prefix(len: usize) -> Vec<u8> {
    (0..len).map(prefix_byte).collect()
}

fn say(what: &str) {
    println!("{LINE}{what}");
}

/// The child's side: runs only when re-run by `prefix_is_shared_with_a_child_process`.
#[test]
fn child_imports_prefix() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let go = std::env::var(GO_ENV).expect("go file");
    let host = HostBackend::open().expect("open host");
    let dev = DeviceId(0);
    let g = host
        .granularity(&AllocationProperties::device(dev))
        .unwrap()
        .recommended;
    let stdin = std::io::stdin();
    let h = host
        .import_posix_fd(kvvm_hal::DeviceId(0), stdin.as_fd())
        .expect("import");
    let va = host.reserve(g, 0, None).unwrap();
    host.map(va, g, h).unwrap();
    host.set_access(va, g, &[AccessDescriptor::read_only(dev)])
        .unwrap();
    let expected = prefix(usize::try_from(g).unwrap());
    let mut got = vec![0u8; expected.len()];
    host.copy_from_device(&mut got, va).unwrap();
    assert!(got == expected, "child: the imported prefix differs");
    let refused = host.copy_to_device(va, b"x").unwrap_err();
    assert_eq!(refused.kind, ErrorKind::InvalidValue);
    let used = host.memory_info(dev).unwrap();
    say(&format!("read-ok used={}", used.total - used.free));

    // Wait until the parent has released and unmapped everything it had.
    let start = Instant::now();
    while !std::path::Path::new(&go).exists() {
        assert!(start.elapsed() < Duration::from_secs(30), "child: no go");
        std::thread::sleep(Duration::from_millis(20));
    }
    got.fill(0);
    host.copy_from_device(&mut got, va).unwrap();
    assert!(
        got == expected,
        "child: the prefix changed after the parent released it"
    );
    say("still-ok");

    // Release while mapped: still readable; freed by the unmap.
    host.release(h).unwrap();
    got.fill(0);
    host.copy_from_device(&mut got, va).unwrap();
    assert!(
        got == expected,
        "child: released-but-mapped memory lost its bytes"
    );
    assert_eq!(host.memory_info(dev).unwrap().free, used.free);
    host.unmap(va, g).unwrap();
    let after = host.memory_info(dev).unwrap();
    assert_eq!(after.free, after.total);
    host.free(va, g).unwrap();
    assert!(host.ledger().is_empty());
    say("done");
}

#[test]
fn prefix_is_shared_with_a_child_process() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let host = Arc::new(HostBackend::open().expect("open host"));
    let backend: Arc<dyn VirtualMemoryBackend> = host.clone();
    let config = VmmConfig {
        handle_type: ShareableHandleType::PosixFd,
        ..VmmConfig::default().pool_cap_bytes(0)
    };
    let vm = VirtualMemory::new(backend, DeviceId(0), Governor::unlimited(), config).unwrap();
    let g = vm.granule();
    let mut owner = vm.reserve(4 * g).unwrap();
    let set = owner.commit_shared(&[(0, g)]).unwrap();
    let data = prefix(usize::try_from(g).unwrap());
    host.copy_to_device(owner.address(), &data).unwrap();
    let (_, handle) = set.window(0).unwrap();
    let fd = host.export_posix_fd(handle).unwrap();

    let go = std::env::temp_dir().join(format!("kvvm-host-go-{}", std::process::id()));
    let _ = std::fs::remove_file(&go);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_imports_prefix",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .env(GO_ENV, &go)
        .stdin(Stdio::from(fd))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    let mut next = |seen: &mut Vec<String>| loop {
        match lines.next() {
            Some(Ok(l)) => {
                // libtest may print "test child_imports_prefix ... " on the same line.
                if let Some((_, rest)) = l.split_once(LINE) {
                    seen.push(rest.to_owned());
                    return Some(rest.to_owned());
                }
            }
            _ => return None,
        }
    };
    let first = next(&mut seen).unwrap_or_default();
    assert!(first.starts_with("read-ok"), "child said {seen:?}");

    // This process lets go of everything: the shared set, the owner's mapping, the handle.
    owner.release().unwrap();
    drop(owner);
    drop(set);
    drop(vm);
    assert!(host.ledger().is_empty(), "{:?}", host.ledger());
    let info = host.memory_info(DeviceId(0)).unwrap();
    assert_eq!(info.free, info.total);

    std::fs::write(&go, b"go").unwrap();
    while next(&mut seen).is_some() {}
    let status = child.wait().unwrap();
    let _ = std::fs::remove_file(&go);
    assert!(
        status.success(),
        "child exited with {status}; said {seen:?}"
    );
    assert_eq!(
        seen.iter()
            .map(|s| s.split(' ').next().unwrap_or(""))
            .collect::<Vec<_>>(),
        ["read-ok", "still-ok", "done"]
    );
}
