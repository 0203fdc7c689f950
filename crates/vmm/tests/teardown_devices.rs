//! Teardown synchronizes every device that may still touch the memory: the manager's own and
//! each device given access to it, once each, and no other.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};

use kvvm_hal::{Access, AccessDescriptor, BackendResult, DeviceId, VirtualMemoryBackend};
use kvvm_sim::{SimBackend, SimConfig};
use kvvm_vmm::{VirtualMemory, VmmConfig};

const G: u64 = 64 << 10;

/// The simulator, recording the device of every synchronize.
struct Syncs {
    sim: Arc<SimBackend>,
    synced: Mutex<Vec<DeviceId>>,
}

impl kvvm_hal::decorate::Forward for Syncs {
    fn inner(&self) -> &dyn VirtualMemoryBackend {
        &*self.sim
    }
    fn name(&self) -> &str {
        "syncs"
    }
    fn synchronize(&self, d: DeviceId) -> BackendResult<()> {
        self.synced.lock().unwrap().push(d);
        self.sim.synchronize(d)
    }
}

fn synced_by_teardown(device: u32, access: Vec<AccessDescriptor>) -> Vec<DeviceId> {
    let syncs = Arc::new(Syncs {
        sim: Arc::new(SimBackend::new(SimConfig::uniform(3, G, 64 * G))),
        synced: Mutex::new(Vec::new()),
    });
    let backend: Arc<dyn VirtualMemoryBackend> = syncs.clone();
    let vm = VirtualMemory::new(
        backend,
        DeviceId(device),
        kvvm_governor::Governor::unlimited(),
        VmmConfig {
            access,
            ..VmmConfig::default()
        },
    )
    .unwrap();
    let mut r = vm.reserve(4 * G).unwrap();
    r.commit(G).unwrap();
    drop(r);
    let synced = syncs.synced.lock().unwrap().clone();
    synced
}

fn rw(d: u32) -> AccessDescriptor {
    AccessDescriptor {
        device: DeviceId(d),
        access: Access::ReadWrite,
    }
}

#[test]
fn teardown_synchronizes_the_managers_own_device() {
    assert_eq!(synced_by_teardown(1, Vec::new()), vec![DeviceId(1)]);
}

#[test]
fn teardown_synchronizes_every_device_given_access_once() {
    let access = vec![rw(1), rw(2), rw(2)];
    assert_eq!(
        synced_by_teardown(1, access),
        vec![DeviceId(1), DeviceId(2)]
    );
}

#[test]
fn a_device_listed_without_access_is_not_synchronized() {
    let access = vec![
        rw(1),
        AccessDescriptor {
            device: DeviceId(0),
            access: Access::None,
        },
        rw(2),
    ];
    assert_eq!(
        synced_by_teardown(1, access),
        vec![DeviceId(1), DeviceId(2)]
    );
}
